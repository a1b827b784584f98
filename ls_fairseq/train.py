"""``ls-fairseq-train``: fairseq-train with the plugin loaded.

The same command line as fairseq-train; ``--user-dir`` pointing at this
package is added when it is not given.
"""
import os
import sys

PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))


def with_user_dir(argv):
    if any(a == "--user-dir" or a.startswith("--user-dir=") for a in argv):
        return list(argv)
    return list(argv) + ["--user-dir", PLUGIN_DIR]


def cli_main():
    from fairseq_cli import train

    sys.argv = [sys.argv[0]] + with_user_dir(sys.argv[1:])
    train.cli_main()


if __name__ == "__main__":
    cli_main()
