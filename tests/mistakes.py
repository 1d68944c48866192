"""Each classic DDP mistake as a small edit of its corrected twin: the diff is the mistake.

``mistake_source(name)`` is good.py (or local_rank_device.py) with that one edit, marked
``# MISTAKE``; tests/test_scriptcheck.py writes it to ``<name>.py`` and checks it.
"""

from pathlib import Path

HERE = Path(__file__).with_name("scripts")  # the twins
TWIN_DOC = '"""A correct DDP script: the corrected twin of every mistake script in this folder.'

SAMPLER = "    sampler = DistributedSampler(train_set, shuffle=True, seed=0)\n"
TRAIN_LOADER = "    train_loader = DataLoader(train_set, batch_size=8, sampler=sampler)\n"
SET_EPOCH = "        sampler.set_epoch(epoch)\n"
VAL_SHARD = (
    "    val_shard = Subset(val_set, range(rank, len(val_set), world_size))  # each sample once\n"
    "    val_loader = DataLoader(val_shard, batch_size=8)\n"
)
INIT = '    dist.init_process_group("gloo")\n'
SAVE = '            torch.save(model.module.state_dict(), "model.pt")\n'

# name -> (the twin, what the mistake is, [(text of the twin, what the mistake writes)])
EDITS = {
    "no_sampler": ("good.py", "no DistributedSampler: every rank trains on the whole set", [
        (SAMPLER + TRAIN_LOADER,
         "    train_loader = DataLoader(train_set, batch_size=8, shuffle=True)  # MISTAKE\n"),
        (SET_EPOCH, ""),
    ]),
    "no_set_epoch": ("good.py", "sampler.set_epoch is never called: every epoch repeats one order", [
        (SET_EPOCH, "        # MISTAKE: no sampler.set_epoch(epoch)\n"),
    ]),
    "no_ddp": ("good.py", "the model is not wrapped in DDP: each rank trains its own model", [
        ("    model = DDP(torch.nn.Linear(4, 1))\n",
         "    model = torch.nn.Linear(4, 1)  # MISTAKE: not DDP(...)\n"),
        (SAVE, SAVE.replace("model.module.", "model.")),
    ]),
    "unequal_steps": ("good.py", "shards of unequal size: ranks take different numbers of steps", [
        (SAMPLER + TRAIN_LOADER,
         "    shard = Subset(train_set, range(rank, len(train_set), world_size))  # MISTAKE: 25 and 24\n"
         "    train_loader = DataLoader(shard, batch_size=8, shuffle=True)\n"),
        (SET_EPOCH, ""),
    ]),
    "padded_val": ("good.py", "validation over a padded DistributedSampler: a sample counts twice", [
        (VAL_SHARD,
         "    val_sampler = DistributedSampler(val_set, shuffle=False)  # MISTAKE: pads 15 to 16\n"
         "    val_loader = DataLoader(val_set, batch_size=8, sampler=val_sampler)\n"),
    ]),
    "every_rank_saves": ("good.py", "every rank writes the same checkpoint file", [
        (SAVE, ""),
        ("        dist.all_reduce(sums)  # sums and counts over every rank\n",
         "        dist.all_reduce(sums)  # sums and counts over every rank\n"
         '        torch.save(model.module.state_dict(), "model.pt")  # MISTAKE: on every rank\n'),
    ]),
    "loopback_init": ("good.py", "init_method fixed to 127.0.0.1: runs on one host, never on two", [
        ("import sys\n", "import os\nimport sys\n"),
        ("EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 3\n",
         "EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 3\n"
         "PORT = int(sys.argv[2]) if len(sys.argv) > 2 else 23456\n"),
        (INIT,
         '    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n'
         "    dist.init_process_group(  # MISTAKE: loopback\n"
         '        "gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=world_size\n'
         "    )\n"),
    ]),
    "fixed_world_size": ("good.py", "a hard-coded world_size: right only for one world", [
        ("import sys\n", "import os\nimport sys\n"),
        (INIT, '    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)'
               "  # MISTAKE\n"),
    ]),
    "loopback_master_addr": ("good.py", "MASTER_ADDR set to localhost: runs on one host only", [
        ("import sys\n", "import os\nimport sys\n"),
        (INIT, '    os.environ["MASTER_ADDR"] = "localhost"  # MISTAKE: overrides torchrun\'s\n'
               + INIT),
    ]),
    "rank0_barrier": ("good.py", "dist.barrier() on rank 0 only: the run hangs after epoch 1", [
        ("        dist.all_reduce(sums)  # sums and counts over every rank\n",
         "        dist.all_reduce(sums)  # sums and counts over every rank\n"
         "        if rank == 0:\n"
         "            dist.barrier()  # MISTAKE: on rank 0 only\n"),
    ]),
    "unordered_read": ("good.py", "every rank reads rank 0's checkpoint with no barrier after the save", [
        ("    dist.destroy_process_group()\n",
         '        model.module.load_state_dict(torch.load("model.pt"))  # MISTAKE: not waited for\n'
         "    dist.destroy_process_group()\n"),
    ]),
    "ddp_eval_rank0": ("bn_rank0_eval.py", "rank 0 evaluates through the DDP wrapper", [
        ("model.module(x)", "model(x)"),
        ("            model.eval()\n", "            model.eval()  # MISTAKE: evaluated through DDP below\n"),
    ]),
    "global_rank_device": ("local_rank_device.py", "the GPU picked by the global rank", [
        ('    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))\n',
         '    device = torch.device("cuda", rank)  # MISTAKE: the global rank, not LOCAL_RANK\n'),
    ]),
}  # fmt: skip


def mistake_source(name: str) -> str:
    """The twin's text with the mistake's edits (each must apply exactly once)."""
    twin, what, edits = EDITS[name]
    text = (HERE / twin).read_text()
    first = text.splitlines()[0]
    doc = f'"""Mistake: {what}.\n\n{twin}, its corrected twin, with one change marked # MISTAKE.'
    text = text.replace(first, doc, 1)
    for old, new in edits:
        assert text.count(old) == 1, f"{name}: {old!r} is not once in {twin}"
        text = text.replace(old, new)
    return text


def write_mistakes(folder: Path) -> Path:
    """Every mistake script as ``folder/<name>.py``; returns folder."""
    for name in EDITS:
        (folder / f"{name}.py").write_text(mistake_source(name))
    return folder
