"""The workload of ``kvtier bench vllm`` (pure Python but for :func:`make_workload`, which reads
the tokenizer and the text): the conversations of the bundled Mooncake trace, scaled down to a
few WikiText-2 tokens per trace block, and the size of a run (:class:`Settings`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import KvtierError
from ...traces import Trace, bundled_trace_path, load_trace

__all__ = [
    "BLOCK",
    "FULL",
    "MIN_SHARED",
    "QUICK",
    "TRACE_BLOCK",
    "Settings",
    "Turn",
    "Workload",
    "build_workload",
    "conversations",
    "corpus_tokens_used",
    "distinct_blocks",
    "last_turn_indices",
    "make_workload",
    "max_model_len",
    "scaled_length",
]

#: vLLM's block size here (the CPU attention backend takes multiples of 32).
BLOCK = 32
#: Tokens of the trace's blocks (its hash ids).
TRACE_BLOCK = 512
#: Leading blocks that requests must share beyond to be turns of one conversation: every request
#: of the Mooncake conversation trace starts with the same block (a system prompt).
MIN_SHARED = 2


@dataclass(frozen=True)
class Settings:
    """The size of a run."""

    #: tokens each trace block (512 tokens, one hash id) becomes
    tokens_per_trace_block: int
    #: longest prompt, tokens (longer conversations are left out)
    max_prompt: int
    #: conversations are taken until their prompts add up to at most this many tokens
    prompt_tokens: int
    #: turns kept of each conversation
    max_turns: int
    #: tokens generated per request (EOS ignored, so every configuration generates the same)
    output_tokens: int
    #: vLLM's own KV pool, blocks of BLOCK tokens (at least one max_model_len request)
    vllm_blocks: int
    #: the kvtier host budget, in bf16 blocks of BLOCK tokens (the same bytes for both ladders)
    host_blocks: int
    #: the long prompt whose hit and recompute TTFT are compared
    probe_tokens: int
    #: hits timed on the long prompt (median)
    probe_hits: int
    #: vLLM's ``max_num_batched_tokens`` in the workload's engines: prompts prefill in chunks of
    #: this many tokens (vLLM's chunked prefill), so a connector saves at most this many tokens'
    #: blocks of one request a step, as in a server whose step is a small part of its host
    #: budget; None leaves vLLM's default scheduling limits (a whole prompt a step here)
    step_tokens: int | None


FULL = Settings(16, 480, 4000, 5, 4, 20, 16, 1536, 3, 32)
QUICK = Settings(8, 224, 1000, 4, 2, 9, 16, 224, 1, 32)


def max_model_len(settings: Settings) -> int:
    """The workload engines' context: the longest prompt and its output, in whole blocks."""
    return -(-(settings.max_prompt + settings.output_tokens) // BLOCK) * BLOCK


@dataclass(frozen=True)
class Turn:
    """One request of the workload."""

    #: its row in the trace
    index: int
    #: the trace row of its conversation's first request
    conversation: int
    #: 0 for a conversation's first request
    turn: int
    #: its trace blocks (hash ids)
    hash_ids: tuple[int, ...]
    #: its prompt, WikiText-2 token ids
    tokens: tuple[int, ...]


def conversations(trace: Trace, min_shared: int = MIN_SHARED) -> dict[int, list[int]]:
    """The trace's requests by conversation (keyed by the row of its first request, each list in
    trace order): a request continues the latest earlier request with which it shares at least
    ``min_shared`` leading blocks, and starts a conversation when there is none."""
    trie: dict[tuple[int, int], int] = {}  # (prefix node, hash id) -> node of the longer prefix
    latest: dict[int, int] = {}  # prefix node -> latest request holding that prefix
    root: list[int] = []
    for i in range(trace.num_requests):
        node, parent, nodes = 0, -1, []
        for depth, h in enumerate(trace.request_hashes(i).tolist()):
            node = trie.setdefault((node, h), len(trie) + 1)
            nodes.append(node)
            if depth + 1 >= min_shared and node in latest:
                parent = latest[node]
        root.append(root[parent] if parent >= 0 else i)
        for n in nodes:
            latest[n] = i
    out: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        out.setdefault(r, []).append(i)
    return out


def scaled_length(input_length: int, blocks: int, tokens_per_block: int) -> int:
    """Prompt tokens of a trace request of ``input_length`` tokens in ``blocks`` trace blocks
    when each block becomes ``tokens_per_block`` tokens (the last, partial block in proportion,
    at least one token)."""
    last = input_length - TRACE_BLOCK * (blocks - 1)
    part = max(1, min(tokens_per_block, round(tokens_per_block * last / TRACE_BLOCK)))
    return (blocks - 1) * tokens_per_block + part


def build_workload(
    trace: Trace,
    corpus: Sequence[int],
    *,
    tokens_per_trace_block: int,
    max_prompt: int,
    prompt_tokens: int,
    max_turns: int,
    min_turns: int = 2,
) -> list[Turn]:
    """The workload: the first conversations of ``trace`` (by their first request) with at least
    ``min_turns`` turns, their first ``max_turns`` turns each, every prompt at most
    ``max_prompt`` tokens, until the prompts would exceed ``prompt_tokens`` in all; in trace
    order. Each trace block becomes the next ``tokens_per_trace_block`` tokens of ``corpus``
    (in order of first use), so equal blocks are equal tokens and different ones differ."""
    s = tokens_per_trace_block
    if s < 1 or max_prompt < 2 or max_turns < min_turns or min_turns < 1:
        raise ValueError(
            f"expected tokens_per_trace_block >= 1, max_prompt >= 2 and max_turns >= min_turns "
            f">= 1, got {s}, {max_prompt}, {max_turns}, {min_turns}"
        )

    def length(i: int) -> int:
        blocks = int(trace.hash_offsets[i + 1] - trace.hash_offsets[i])
        return scaled_length(int(trace.input_lengths[i]), blocks, s)

    chosen: list[tuple[int, int, int]] = []  # (row, conversation, turn)
    total = 0
    for first, rows in conversations(trace).items():
        rows = rows[:max_turns]
        if len(rows) < min_turns or any(length(i) > max_prompt for i in rows):
            continue
        cost = sum(length(i) for i in rows)
        if total + cost > prompt_tokens:
            break
        total += cost
        chosen += [(i, first, t) for t, i in enumerate(rows)]
    if not chosen:
        raise KvtierError(
            f"no conversation of the trace fits: raise the prompt budget ({prompt_tokens}) or "
            f"the longest prompt ({max_prompt})"
        )
    chosen.sort()
    chunks: dict[int, int] = {}
    turns = []
    for i, first, t in chosen:
        hashes = tuple(int(h) for h in trace.request_hashes(i))
        tokens: list[int] = []
        for h in hashes:
            c = chunks.setdefault(h, len(chunks))
            if (c + 1) * s > len(corpus):
                raise KvtierError(f"the corpus has {len(corpus)} tokens; the workload needs more")
            tokens += corpus[c * s : (c + 1) * s]
        turns.append(Turn(i, first, t, hashes, tuple(tokens[: length(i)])))
    return turns


def last_turn_indices(turns: Sequence[Turn]) -> set[int]:
    """The positions in ``turns`` of each conversation's last turn."""
    last = {t.conversation: n for n, t in enumerate(turns)}
    return set(last.values())


def corpus_tokens_used(turns: Sequence[Turn], tokens_per_trace_block: int) -> int:
    """Tokens of the corpus the workload's prompts come from (what follows is free)."""
    return len({h for t in turns for h in t.hash_ids}) * tokens_per_trace_block


def distinct_blocks(turns: Sequence[Turn], block: int = BLOCK) -> int:
    """Complete blocks of ``block`` tokens, counted once per distinct prefix: what a cache that
    never forgets would hold after the workload."""
    seen = {t.tokens[:end] for t in turns for end in range(block, len(t.tokens) + 1, block)}
    return len(seen)


@dataclass(frozen=True)
class Workload:
    """What every configuration runs: the model, the requests, the long prompt and the
    warm-up's tokens."""

    model_dir: Path
    turns: list[Turn]
    probe: list[int]
    warm: list[int]


def make_workload(settings: Settings) -> Workload:
    """The requests of ``settings`` from the bundled trace, with WikiText-2 tokens."""
    from transformers import AutoTokenizer

    from ...eval.model import smollm2_hf_dir, wikitext_ids

    model_dir = smollm2_hf_dir()
    trace = load_trace(bundled_trace_path())
    # Enough text for any workload of this size, the long prompt and the warm-up.
    need = 3 * settings.prompt_tokens + settings.probe_tokens + BLOCK
    corpus = [int(t) for t in wikitext_ids(AutoTokenizer.from_pretrained(model_dir), need)]
    turns = build_workload(
        trace,
        corpus,
        tokens_per_trace_block=settings.tokens_per_trace_block,
        max_prompt=settings.max_prompt,
        prompt_tokens=settings.prompt_tokens,
        max_turns=settings.max_turns,
    )
    at = corpus_tokens_used(turns, settings.tokens_per_trace_block)
    probe = corpus[at : at + settings.probe_tokens]
    warm = corpus[at + settings.probe_tokens : at + settings.probe_tokens + BLOCK]
    if len(probe) < settings.probe_tokens or len(warm) < BLOCK:
        raise KvtierError(f"WikiText-2 gave {len(corpus)} tokens, fewer than the run needs")
    return Workload(model_dir, turns, probe, warm)
