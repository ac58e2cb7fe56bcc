"""The `k2serve` dispatcher: subcommand found after global options, help without a command."""

import subprocess
import sys

from k2serve.cli import COMMANDS, main


def test_global_option_value_before_command(capsys):
    # "WARNING" is an option value, not a command: `plan --help` must still be reached.
    try:
        main(["--log-level", "WARNING", "plan", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "--gpus" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_every_command_module_has_the_entry_points():
    import importlib

    for name, (module, _) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments), name
        assert callable(mod.run), name


def test_console_script_version():
    out = subprocess.run(
        [sys.executable, "-m", "k2serve.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("k2serve ")
