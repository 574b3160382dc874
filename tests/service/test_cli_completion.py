"""``zerotrain completion bash|zsh`` prints a static script made from the CLI's argparse tree;
the bash one is driven here through bash's own ``complete`` machinery, as a shell would."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from service.cli import main
from service.cli.main import build_parser


def script(capsys, shell: str) -> str:
    assert main(["completion", shell]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def complete(bash_script: str, line: str) -> list[str]:
    """What bash offers for the last word of ``line`` (empty after a trailing space), through the
    function the script registered with ``complete -F`` for ``zerotrain``."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    driver = f"""
{bash_script}
spec=$(complete -p zerotrain) || exit 3
function=${{spec##*-F }}; function=${{function%% *}}
COMP_WORDS=({" ".join(shlex.quote(w) for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE={shlex.quote(line)}; COMP_POINT=${{#COMP_LINE}}
"$function" zerotrain {shlex.quote(words[-1])} {shlex.quote(words[-2])}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", driver], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return [word.strip() for word in result.stdout.splitlines() if word.strip()]


def test_the_bash_script_is_valid_bash(capsys, tmp_path):
    path = tmp_path / "zerotrain.bash"
    path.write_text(script(capsys, "bash"))
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("line, offered", [
    ("zerotrain j", ["jobs"]),
    ("zerotrain c", ["cancel", "checkpoints", "ckpt", "completion"]),
    ("zerotrain token ", ["create", "list", "revoke"]),
    ("zerotrain jobs --st", ["--state"]),
    ("zerotrain completion ", ["bash", "zsh"]),
])
def test_bash_completes_commands_subcommands_flags_and_choices(capsys, line, offered):
    assert sorted(complete(script(capsys, "bash"), line)) == offered


def test_the_zsh_script_is_a_compdef_for_every_command(capsys):
    text = script(capsys, "zsh")
    assert text.startswith("#compdef zerotrain")
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"jobs", "submit", "completion"} <= set(commands)
    entries = {line.strip().split(":")[0] for line in text.splitlines() if ":'" in line}
    assert set(commands) <= entries, set(commands) - entries  # zsh's _describe entries: name:'help'


def test_an_unknown_shell_is_a_usage_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["completion", "fish"])
    assert exited.value.code == 2
    assert "invalid choice: 'fish'" in capsys.readouterr().err
