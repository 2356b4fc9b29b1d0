"""Run the `veloxquant` CLI in process: (exit code, stdout, stderr), never a traceback."""

from veloxquant_mlx.cli.main import main


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err
