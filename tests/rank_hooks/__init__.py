"""A fairseq --user-dir for the multi-GPU tests: loads the ls_fairseq plugin and,
after every training step, writes this rank's update count and a checksum of
its parameters to $LS_TEST_RANK_DIR/rank<R>.txt, so a test can see that the
data-parallel ranks hold the same parameters. With $LS_TEST_KILL="R U", rank R
kills itself (SIGKILL: no handler, no message of its own) after update U; with
$LS_TEST_HANG="R U" it stops there (sleeps) without exiting."""
import hashlib
import os
import signal
import time

from fairseq.trainer import Trainer

import ls_fairseq.fairseq_plugin  # noqa: F401 (registers the plugin)

_train_step = Trainer.train_step


def _train_step_and_record(self, samples, raise_oom=False):
    out = _train_step(self, samples, raise_oom)
    folder = os.environ.get("LS_TEST_RANK_DIR")
    if folder:
        digest = hashlib.sha256()
        for p in self.model.parameters():
            digest.update(p.detach().float().cpu().numpy().tobytes())
        with open(os.path.join(folder, "rank{}.txt".format(self.data_parallel_rank)), "w") as f:
            f.write("{} {}\n".format(self.get_num_updates(), digest.hexdigest()))
    kill = os.environ.get("LS_TEST_KILL", "").split()
    if kill and self.data_parallel_rank == int(kill[0]) and self.get_num_updates() >= int(kill[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    hang = os.environ.get("LS_TEST_HANG", "").split()
    if hang and self.data_parallel_rank == int(hang[0]) and self.get_num_updates() >= int(hang[1]):
        time.sleep(3600)
    return out


Trainer.train_step = _train_step_and_record
