"""The test command's own machinery: scripts/test.sh runs pytest-xdist with --dist loadgroup, and the
modules whose tests share a trained model (test_generate, test_lm_cli) mark them with one xdist_group so
that one worker builds it."""
import sys
import textwrap

from conftest import run


def test_pytest_xdist_keeps_an_xdist_group_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent('''
        import pytest
        pytestmark = pytest.mark.xdist_group("one")

        @pytest.mark.parametrize("i", range(6))
        def test_member(i):
            pass
        '''), encoding="utf-8")
    proc = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
                str(tmp_path / "test_grouped.py")], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:]
    workers = {line.split("]")[0] for line in proc.stdout.splitlines() if "PASSED" in line}
    assert len(workers) == 1 and proc.stdout.count("PASSED") == 6, proc.stdout[-2000:]
