"""The core changes nothing and needs no fairseq; ls_fairseq.fairseq_plugin's install() makes every change
to fairseq and torch, those it lists; a relaunched finished run trains nothing."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, USER_DIR, bin_path, run

CORE = ["ls_fairseq", "ls_fairseq.ops", "ls_fairseq.layers", "ls_fairseq.models.layers",
        "ls_fairseq.optim.workspace_adam", "ls_fairseq.loss"]

# makes every import of fairseq fail, as where it is not installed
BLOCK_FAIRSEQ = textwrap.dedent("""
    import sys

    class NoFairseq:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("fairseq", "fairseq_cli"):
                raise ImportError("fairseq is not installed here (blocked by the test)")

    sys.meta_path.insert(0, NoFairseq())
""")


def python(script):
    """Runs ``script`` in a fresh interpreter (the tests' helpers importable); returns its last line as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_modules_imported_by(prelude):
    """The modules of torch's own that a fresh interpreter has loaded after running ``prelude``. The tests
    import them before their first snapshot: importing some of them changes torch (torch's own
    submodules, e.g. torch.nn.attention.varlen, rewrap torch.manual_seed), which is no change of ours."""
    script = prelude + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    return python(script)


PRELOAD = "import importlib\nfor name in {!r}:\n    importlib.import_module(name)\n"


def test_the_cores_tests_pass_without_fairseq():
    script = BLOCK_FAIRSEQ + textwrap.dedent("""
        import contextlib
        import io
        import json
        import pytest
        try:
            import fairseq  # noqa: F401
            blocked = False
        except ImportError:
            blocked = True
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_core.py"])
        print(json.dumps({"blocked": blocked, "rc": int(rc), "log": log.getvalue()[-4000:] if rc else "",
                          "fairseq": [m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_cli")]}))
    """)
    out = python(script)
    assert out == {"blocked": True, "rc": 0, "log": "", "fairseq": []}, out["log"]  # a failure's report and seed


def test_importing_the_core_changes_nothing_in_torch():
    core = "import importlib\nfor name in {!r}:\n    importlib.import_module(name)".format(CORE)
    script = PRELOAD.format(torch_modules_imported_by(core)) + textwrap.dedent("""
        import importlib, json
        import torch
        import attributes
        before, safe = attributes.snapshot({"torch"}), list(torch.serialization.get_safe_globals())
        for name in %r:
            importlib.import_module(name)
        after = attributes.snapshot({"torch"})
        print(json.dumps({"checked": len(before), "changed": sorted(map(list, attributes.changes(before, after))),
                          "safe_globals": list(map(repr, safe)) == list(map(repr, torch.serialization.get_safe_globals()))}))
    """ % CORE)
    out = python(script)
    assert out["checked"] > 10000 and out["changed"] == [] and out["safe_globals"]


def test_only_install_changes_fairseq_and_torch_and_it_makes_the_listed_patches():
    everything = textwrap.dedent("""
        import importlib, pathlib
        import ls_fairseq.fairseq_plugin
        root = pathlib.Path(ls_fairseq.__file__).parent
        for p in root.rglob("*.py"):
            importlib.import_module(".".join(("ls_fairseq",) + p.relative_to(root).with_suffix("").parts).replace(".__init__", ""))
        ls_fairseq.fairseq_plugin.install(ls_trainer=True)
    """)
    script = PRELOAD.format(torch_modules_imported_by(everything)) + textwrap.dedent("""
        import importlib, json, pathlib, sys
        import torch
        import fairseq_cli.train, fairseq.tasks.translation, fairseq.checkpoint_utils, fairseq.trainer
        import fairseq.data.iterators, fairseq.models, fairseq.criterions, fairseq.optim
        import attributes
        import ls_fairseq

        packages = {"torch", "fairseq", "fairseq_cli"}
        registries = {m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_cli")}
        root = pathlib.Path(ls_fairseq.__file__).parent
        modules = sorted(".".join(("ls_fairseq",) + p.relative_to(root).with_suffix("").parts).replace(".__init__", "")
                         for p in root.rglob("*.py") if "fairseq_plugin" not in p.parts)
        before, safe = attributes.snapshot(packages, registries), set(torch.serialization.get_safe_globals())
        for name in modules:
            importlib.import_module(name)
        imported = attributes.snapshot(packages, registries)
        from ls_fairseq import fairseq_plugin  # installs
        installed = attributes.snapshot(packages, registries)
        fairseq_plugin.install()
        again = attributes.snapshot(packages, registries)
        fairseq_plugin.install(ls_trainer=True)
        with_trainer = attributes.snapshot(packages, registries)

        def key(patch):
            if isinstance(patch.owner, type):
                return [patch.owner.__module__, patch.owner.__name__ + "." + patch.name]
            return [patch.owner.__name__, patch.name]

        listed = [key(p) for p in fairseq_plugin.patches()]
        from ls_fairseq.models.ls_transformer import ARCHITECTURES
        from ls_fairseq.models.ls_transformer_lm import ARCHITECTURES as LM_ARCHITECTURES
        print(json.dumps({
            "modules": len(modules),
            "at_import": sorted(map(list, attributes.changes(before, imported))),
            "at_install": sorted(map(list, attributes.changes(imported, installed))),
            "again": sorted(map(list, attributes.changes(installed, again))),
            "trainer": sorted(map(list, attributes.changes(again, with_trainer))),
            "listed": sorted(listed), "whys": [p.why for p in fairseq_plugin.patches(ls_trainer=True)],
            "names": ["ls_transformer", "ls_transformer_lm", "ls_label_smoothed_cross_entropy", "ls_adam"]
                     + sorted(ARCHITECTURES) + sorted(LM_ARCHITECTURES),
            "safe_globals": sorted(map(repr, set(torch.serialization.get_safe_globals()) - safe)),
            "trainer_is": repr(fairseq_cli.train.Trainer),
        }))
    """)
    out = python(script)
    assert out["modules"] > 40 and out["at_import"] == []  # importing everything but the plugin changes nothing
    registry = [k for k in out["at_install"] if "[" in k[1]]
    patched = [k for k in out["at_install"] if "[" not in k[1]]
    # install(): the listed patches, torch's safe-globals set, and the registrations of the plugin's names
    assert sorted(patched) == sorted(out["listed"] + [["torch._weights_only_unpickler", "_marked_safe_globals_set"]])
    assert len(out["listed"]) == 12 and all(len(why) > 30 for why in out["whys"])
    assert registry and all(any("['{}']".format(n) in k[1] for n in out["names"]) for k in registry)
    registered = {n for n in out["names"] if any("['{}']".format(n) in k[1] for k in registry)}
    assert registered == set(out["names"])
    assert out["safe_globals"] == ["<class 'argparse.Namespace'>"]
    assert out["again"] == []  # installing twice changes nothing the second time
    assert out["trainer"] == [["fairseq_cli.train", "Trainer"]]
    assert out["trainer_is"] == "<class 'ls_fairseq.trainer.LSTrainer'>"


def test_the_user_dir_installs_unless_the_core_came_first():
    """fairseq imports a --user-dir only under a name not yet imported: --user-dir ls_fairseq installs the
    plugin in a fresh process, nothing where ls_fairseq was imported before (documented: call install()),
    and the plugin's own folder, a name of its own, installs either way."""
    script = textwrap.dedent("""
        import argparse, json, os
        from fairseq import utils
        from fairseq.models import ARCH_MODEL_REGISTRY
        first = %r
        if first:
            import ls_fairseq, ls_fairseq.ops, ls_fairseq.models.ls_transformer  # the core (and the model) first
        utils.import_user_module(argparse.Namespace(user_dir=%r))
        after_user_dir = "ls_transformer_tiny" in ARCH_MODEL_REGISTRY
        utils.import_user_module(argparse.Namespace(user_dir=os.path.join(%r, "fairseq_plugin")))
        print(json.dumps([after_user_dir, "ls_transformer_tiny" in ARCH_MODEL_REGISTRY]))
    """)
    assert python(script % (False, USER_DIR, USER_DIR)) == [True, True]
    assert python(script % (True, USER_DIR, USER_DIR)) == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["fairseq-train", "ls-fairseq-train"])
def test_a_relaunched_finished_run_trains_no_further_update(data_bin, tmp_path, entry):
    from test_cli import TRAIN, updates

    import torch

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the checkpoint types for torch.load)

    save = tmp_path / "ckpt"
    cmd = ([bin_path("fairseq-train"), "--user-dir", USER_DIR] if entry == "fairseq-train"
           else [sys.executable, "-m", "ls_fairseq.train"])
    cmd += [str(data_bin / "data-bin")] + TRAIN + ["--save-dir", str(save), "--max-update", "6"]
    first = run(cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert max(updates(first.stdout + first.stderr)) == 6
    again = run(cmd)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    notices = [line for line in log.splitlines() if "the run is finished" in line]
    assert len(notices) == 1 and "at update 6, --max-update 6" in notices[0], log[-3000:]
    assert max(updates(log), default=6) == 6
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 6
