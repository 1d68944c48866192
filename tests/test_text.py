"""Long command lines print one option per line and still paste as the same command."""

import shlex

import ddpnb
from ddpnb.text import WIDTH, wrap_command, wrap_commands


def _pasted(text: str) -> list[list[str]]:
    """What a shell reads from ``text``: continuations joined, comments dropped."""
    return [shlex.split(line, comments=True) for line in text.replace(" \\\n", " ").splitlines()]


def test_node_commands_split_at_options_and_paste_as_the_same_words():
    cfg = ddpnb.TrainConfig(data_dir="/shared/data/digits")
    hosts = ["10.0.0.1", "10.0.0.2"]
    commands = ddpnb.node_commands(cfg, "/shared/ddpnb/run", hosts=hosts, rendezvous="c10d")
    shown = wrap_commands(ddpnb.cluster.format_node_commands(hosts, commands))
    assert max(len(line) for line in shown.splitlines() if not line.startswith("#")) <= WIDTH
    assert "    --rdzv_endpoint=10.0.0.1:29500 \\\n" in shown  # whole, on its own line
    assert "    --config /shared/ddpnb/run/config.json" in shown  # an option with its value
    assert [w for w in _pasted(shown) if w] == [shlex.split(c) for c in commands]


def test_quoted_words_assignments_and_comments_stay_whole():
    line = "ssh -o BatchMode=yes -T -- gpu1  # runs, on that host:"
    remote = (
        "    cd /r && exec env A=1 B=2 /usr/bin/python -c '<agent>' '--prefix=[rank${rank}] ' x.py"
    )
    assert wrap_command(line, width=30).splitlines() == [
        "ssh \\",
        "    -o BatchMode=yes \\",
        "    -T \\",
        "    -- gpu1  # runs, on that host:",
    ]
    assert wrap_command(remote, width=30).splitlines() == [
        "    cd /r && exec env \\",
        "        A=1 \\",
        "        B=2 \\",
        "        /usr/bin/python \\",
        "        -c '<agent>' \\",
        "        '--prefix=[rank${rank}] ' \\",
        "        x.py",
    ]
    assert _pasted(wrap_command(remote, width=30)) == [shlex.split(remote)]


def test_short_lines_comments_and_unbalanced_quotes_are_left_alone():
    assert wrap_command("torchrun --nnodes=2 train.py") == "torchrun --nnodes=2 train.py"
    comment = "# " + "x " * 60
    assert wrap_command(comment, width=20) == comment
    broken = "echo 'unbalanced --a=1 --b=2"
    assert wrap_command(broken, width=10) == broken
