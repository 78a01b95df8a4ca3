"""How a training update is timed and its memory measured, the same way by the benchmark and the
studies: one update as fairseq-train makes it (without the data loader), timed with
torch.utils.benchmark, peak memory from the allocator."""

import itertools

import torch
from torch.utils import benchmark


def training_step(model, tokens, targets, masked):
    """One update as fairseq-train makes it: the masked-LM logits at the ``masked`` positions
    (fairseq's masked_lm task and criterion), cross-entropy, backward, Adam step. Returns the step."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens, masked_tokens=masked)[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[masked])
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def classification_step(model, tokens, labels, head="timing"):
    """One finetuning update as fairseq's sentence_prediction makes it: <s>'s features through a
    classification head (registered as ``head``), cross-entropy, backward, Adam step."""
    model.register_classification_head(head, num_classes=int(labels.max()) + 1)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens, features_only=True, classification_head_name=head)[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def prediction_step(model, tokens, head="timing"):
    """The forward pass that predicts ``tokens``' classes (no gradients, eval mode)."""
    model.eval()

    def step():
        with torch.no_grad():
            return model(tokens, features_only=True, classification_head_name=head)[0]

    return step


def seconds_per_step(step, min_run_time):
    """Seconds per step, one sample per block of steps (blocked_autorange warms up while it sizes the blocks)."""
    # Timer runs on one thread unless told otherwise
    timer = benchmark.Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).times


def peak_bytes(step, device="cpu"):
    """The most memory the allocator held during one step beyond what it held before it."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        return torch.cuda.max_memory_allocated() - before
    # the CPU allocator keeps no peak counter, but the profiler records its every allocation and free
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return max(itertools.accumulate((e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())), initial=0))
