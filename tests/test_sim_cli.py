"""`swarm-sim`'s command line, at the parse level (no root, no lab)."""

import pytest

from sim import cli

JOB = ["swarmctl", "jobs", "run", "--nodes", "1", "--", "python", "-c", "print(1)"]


@pytest.mark.parametrize("words, name, command", [
    (["--name", "X", "h2", "--", *JOB], "X", JOB),  # the regression: the command's own -- kept it
    (["h2", "--name", "X", "--", *JOB], "X", JOB),  # options may stand between the host and the --
    (["--name=X", "h2", "--", *JOB], "X", JOB),
    (["h2", "--", *JOB], "lab", JOB),
    (["h2", *JOB], "lab", JOB),  # no -- of its own: the command starts at the first word after the host
    (["--name", "X", "h2", "--", "--name", "Y", "--"], "X", ["--name", "Y", "--"]),  # verbatim, -- included
    (["h2", "ls", "-l"], "lab", ["ls", "-l"]),
    (["h2"], "lab", []),
])
def test_lab_exec_passes_everything_after_its_own_double_dash_verbatim(words, name, command):
    args = cli.parse(["lab", "exec", *words])
    assert (args.command, args.name, args.host, args.argv) == ("exec", name, "h2", command)


def test_lab_exec_names_the_lab_the_user_named(capsys):
    code = cli.main(["lab", "exec", "--name", "no-such-lab-here", "h2", "--", *JOB])
    assert code == 2
    assert "no lab named 'no-such-lab-here'" in capsys.readouterr().err


def test_other_commands_parse_as_before():
    args = cli.parse(["lab", "status", "--name", "q", "--json"])
    assert (args.command, args.name, args.json) == ("status", "q", True)
