"""Every fenced block of README.md and of the guides under docs/ runs (or is checked against
what it shows), so the docs cannot drift from the API, the command line or the Makefile again.

Each fenced block is one test case, named by its file, line and heading
(``README-L67-the-api-in-brief``, ``vllm-L30-extra-config-keys``; pytest's ``-k`` takes any of
them). The heading is the nearest one above the block, of any level. The rules, by the block's
kind:

``python``
    The block runs as one script (``exec``) in a fresh namespace, from the repository root, with
    every ``KVTIER_*`` and ``VLLM_*`` variable cleared (so ``from_env()`` gives the defaults the
    docs describe). Tracebacks name the file and its line numbers. Before it runs:

    - Placeholders a CPU test machine cannot run are swapped by the rules in ``SUBSTITUTIONS``:
      textual, for the blocks under one heading, each asserted to match (a rule that no longer
      matches fails the case instead of silently doing nothing). Today: ``device="cuda"`` ->
      ``"cpu"``; Llama-3-8B's manager shape (32 layers, 8 KV heads, head_dim 128) -> 2 layers,
      2 heads, head_dim 32 (int4's groups of 32 still fit), and ``range(32)``, the loop over
      its layers, with it; a 16 GiB host tier (its pools are allocated at once) -> 16 MiB;
      ``max_new_tokens=256`` -> 8 on a CPU; ``redis://cache:6379`` -> the URL of the test's own
      redis-server on 127.0.0.1 (no other network traffic).
    - Names the block uses without defining them are given by ``GIVENS``, real objects of the
      type and shape the block assumes: ``prompt_ids`` (40 token ids), ``k``/``v`` (fp16
      ``[40, kv_heads, head_dim]`` of the substituted shape), ``q`` (fp16 ``[1, 4 * kv_heads,
      head_dim]``: a decode step's queries), ``attn_weights`` (``[heads, 1,
      40]``, rows summing to 1), ``model``/``inputs`` (a two-layer transformers Llama in bf16,
      the dtype the block's ladder starts with, at its random initialization, and a tokenizer's
      ``input_ids``/``attention_mask`` of 40 tokens: SmolLM2 from its GGUF file would take
      longer to load than this whole file may run), ``prefix_hashes``/``blocks`` (the core's
      hashes of 64 tokens, and one int4-packed block of the namespace's shape per hash). A name
      neither defined nor given fails the case.

``sh`` (or ``bash``, ``shell``)
    Each line is a command, run with bash from the repository root with the running Python's
    bin directory (``.venv/bin``) first on PATH and ``KVTIER_*``/``VLLM_*`` cleared; it must exit
    0. Exceptions, both by rule: ``make test`` is skipped (it runs this file: recursion), and
    ``make TARGET`` runs as ``make -o develop TARGET``: the extension under test is the one
    already built, a test never rebuilds it.

untagged blocks (output, not commands)
    A block that starts with ``options:`` must equal what ``kvtier simulate --help`` prints from
    ``options:`` on, at ``COLUMNS=HELP_COLUMNS`` (the width the README was pasted at). A one-line
    block ``kvtier simulate [TRACE] [options]`` must agree with --help's usage: the same command,
    each bracketed name an optional positional (in any case: the README writes placeholders in
    capitals), and nothing else but optional options.

``json``
    A vLLM ``--kv-transfer-config`` value: it must parse, its ``kv_connector_extra_config`` must
    make a valid :func:`kvtier.integrations.vllm.connector_config` (every key a config field,
    every value of the right kind), and, when vLLM is installed, it must name the connector
    class of the module it names. For vLLM's own ``OffloadingConnector``: vLLM must resolve
    the cache policy it names (kvtier's, out of tree) to a ``CachePolicy``.

``console``
    Commands that measure, too long for a test (a benchmark, an eval): each command (lines
    ending in ``\\`` continue it; leading ``VAR=value`` words, a ``> file`` redirection and what
    follows ``#`` aside) runs with every argparse parser it builds stopping the run once it has
    parsed a command line with no ``REMAINDER`` left to hand on: the command exists and takes
    those options, and nothing is measured.

``schema``
    The shape of ``kvtier simulate --json``'s result: every ``"key":`` it names is a key of a
    real result (the bundled trace's first requests, with kvtier's policies and a peer of each
    kind).

``mermaid``
    A diagram: it must start with ``flowchart`` or ``graph`` (what renders on GitHub and in the
    docs site).

Any other block (another language, other output) fails: run it or give it a rule here.
Cases that need transformers are marked ``hf``, those that need redis-server ``redis``.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: The files whose blocks run: the README and the guides (not the results' own READMEs, nor the
#: generated API reference).
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]

#: The terminal width the README's ``kvtier simulate --help`` listing was pasted at.
HELP_COLUMNS = 100

#: The shape the BlockManager example gets instead of Llama-3-8B's (and its givens follow).
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
#: Tokens of the given prompt: two full 16-token blocks and a partial one.
PROMPT_TOKENS = 40
#: Vocabulary of the given transformers model.
VOCAB = 512
#: Tokens behind the given prefix hashes (one hash per 16).
HASHED_TOKENS = 64

SH_LANGS = ("sh", "bash", "shell")

# ---------------------------------------------------------------------------------------------
# The blocks


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # the fence's tag, lower case; "" when untagged
    heading: str  # the nearest heading above it, without the hashes and backticks
    text: str
    doc: str = "README.md"  # the file, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def id(self) -> str:
        words = re.findall(r"[a-z0-9]+", self.heading.lower())
        while len("-".join(words)) > 40:
            words.pop()
        return "-".join([Path(self.doc).stem, f"L{self.line}", *words])


def readme_blocks(text: str, doc: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text``, in order, with their tag, line and heading."""
    blocks: list[Block] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#{1,4} ", line):
            heading = line.lstrip("#").replace("`", "").strip()
        fence = re.match(r"^(```+)\s*([\w+-]*)\s*$", line)
        if fence:
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), None
            )
            assert end is not None, f"{doc}:{i + 1}: fence never closed"
            body = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(i + 1, fence.group(2).lower(), heading, body, doc))
            i = end
        i += 1
    return blocks


BLOCKS = [
    block
    for path in DOCS
    for block in readme_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
]

# ---------------------------------------------------------------------------------------------
# Substitutions and givens for the python blocks


@dataclass(frozen=True)
class Sub:
    """Replace ``old`` by ``new`` in the python blocks under the heading starting ``section``.

    ``new`` may name ``{redis_url}``: the URL of the test's redis-server (``needs`` it)."""

    section: str | tuple[str, ...]  # the start of the heading, or of any of several
    old: str
    new: str
    why: str
    needs: str | None = None


SUBSTITUTIONS: tuple[Sub, ...] = (
    Sub("BlockManager", 'device="cuda"', 'device="cpu"', "the test machine has no GPU"),
    Sub(
        "BlockManager",
        "num_layers=32, num_kv_heads=8, head_dim=128",
        f"num_layers={LAYERS}, num_kv_heads={KV_HEADS}, head_dim={HEAD_DIM}",
        "Llama-3-8B's shape: 4096 of its blocks are 8 GiB",
    ),
    Sub("BlockManager", "range(32)", f"range({LAYERS})", "the loop over the model's layers"),
    Sub(
        "BlockManager",
        'host_budget="16GiB"',
        'host_budget="16MiB"',
        "a BlockManager allocates each tier's pools at once",
    ),
    Sub(
        ("Hugging Face", "TieredCache"),
        "max_new_tokens=256",
        "max_new_tokens=8",
        "each token goes through a TieredCache step; 256 take a while on two CPU cores",
    ),
    Sub(
        "Storage tiers",
        "redis://cache:6379",
        "{redis_url}",
        "the test's own redis-server on 127.0.0.1",
        needs="redis_server",
    ),
)


def substitutions_for(block: Block) -> list[Sub]:
    return [s for s in SUBSTITUTIONS if block.heading.startswith(s.section)]


def substituted(block: Block, values: dict[str, str]) -> tuple[str, list[Sub]]:
    """The block's source after its substitutions, and those that matched nothing."""
    source, unmatched = block.text, []
    for sub in substitutions_for(block):
        if sub.old not in source:
            unmatched.append(sub)
        source = source.replace(sub.old, sub.new.format(**values))
    return source, unmatched


def free_names(source: str) -> list[str]:
    """Names ``source`` reads but never binds (assignment, import, def, argument), builtins
    aside: what it expects to be given."""
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return sorted(n for n in read - bound if not hasattr(builtins, n))


def _torch() -> Any:
    return pytest.importorskip("torch")


def _prompt_ids(request: pytest.FixtureRequest) -> list[int]:
    return list(range(1, PROMPT_TOKENS + 1))


def _kv(request: pytest.FixtureRequest) -> Any:
    torch = _torch()
    return torch.randn(PROMPT_TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.float16)


def _queries(request: pytest.FixtureRequest) -> Any:
    torch = _torch()
    return torch.randn(1, 4 * KV_HEADS, HEAD_DIM, dtype=torch.float16)


def _attn_weights(request: pytest.FixtureRequest) -> Any:
    torch = _torch()
    return torch.rand(KV_HEADS, 1, PROMPT_TOKENS).softmax(-1)


def _model(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("tiny_llama")


def _inputs(request: pytest.FixtureRequest) -> dict[str, Any]:
    torch = _torch()
    ids = torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # a tokenizer's keys


def _prefix_hashes(request: pytest.FixtureRequest) -> Any:
    import kvtier

    return kvtier.prefix_hashes(np.arange(HASHED_TOKENS, dtype=np.uint32), 16)


def _blocks(request: pytest.FixtureRequest) -> list[Any]:
    from kvtier.codecs import BlockShape, get_codec

    # the namespace's int4, 32x8x16x128: one packed block per prefix hash
    size = get_codec("int4").bytes_per_block(BlockShape(32, 8, 16, 128))
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(HASHED_TOKENS // 16)]


#: name -> (factory, marker of what it needs or None)
GIVENS: dict[str, tuple[Callable[[pytest.FixtureRequest], Any], str | None]] = {
    "prompt_ids": (_prompt_ids, None),
    "k": (_kv, None),
    "v": (_kv, None),
    "q": (_queries, None),
    "attn_weights": (_attn_weights, None),
    "model": (_model, "hf"),
    "inputs": (_inputs, "hf"),
    "prefix_hashes": (_prefix_hashes, None),
    "blocks": (_blocks, None),
}


def _marks(block: Block) -> list[Any]:
    marks = []
    if block.lang == "python":
        source, _ = substituted(block, {"redis_url": "redis://127.0.0.1:1"})
        needs = {GIVENS[n][1] for n in free_names(source) if n in GIVENS}
        needs |= {"redis" for s in substitutions_for(block) if s.needs == "redis_server"}
        marks = [getattr(pytest.mark, m) for m in sorted(n for n in needs if n)]
    return marks


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    """A real transformers Llama, two layers of head_dim 32 in bf16, at its random
    initialization: the block exercises the API, not the text (SmolLM2 from its GGUF file
    takes 30-60 s to load on two cores, more than this whole file may)."""
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No KVTIER_*/VLLM_* variables; the running Python's bin first on PATH."""
    for name in list(os.environ):
        if name.startswith(("KVTIER_", "VLLM_")):
            monkeypatch.delenv(name)
    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.chdir(REPO)
    return dict(os.environ)


def bash(command: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---------------------------------------------------------------------------------------------
# The cases


def run_python(block: Block, request: pytest.FixtureRequest) -> None:
    values = {}
    if any(s.needs == "redis_server" for s in substitutions_for(block)):
        values["redis_url"] = request.getfixturevalue("redis_server").url
    source, unmatched = substituted(block, values)
    assert not unmatched, (
        f"{block.where}: substitution(s) that no longer match the block: "
        + "; ".join(f"{s.old!r} -> {s.new!r}" for s in unmatched)
        + " (update SUBSTITUTIONS in tests/test_readme.py)"
    )
    names = free_names(source)
    unknown = [n for n in names if n not in GIVENS]
    assert not unknown, (
        f"{block.where}: the block uses {', '.join(unknown)} without defining them; "
        "define them in the block or give them in GIVENS"
    )
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    for name in names:
        namespace[name] = GIVENS[name][0](request)
    tree = ast.parse(source)
    ast.increment_lineno(tree, block.line)  # tracebacks point at the doc's lines
    try:
        exec(compile(tree, str(REPO / block.doc), "exec"), namespace)
    finally:
        for value in namespace.values():
            if type(value).__module__.startswith("kvtier.") and callable(
                getattr(value, "close", None)
            ):
                value.close()


def sh_commands(block: Block) -> list[tuple[int, str]]:
    """``(line, command)`` of each command line, by the rules: ``make test`` skipped, ``make
    TARGET`` without rebuilding the extension."""
    out = []
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        if command == "make test":  # runs this file: recursion
            continue
        if command.startswith("make "):
            command = "make -o develop " + command.removeprefix("make ")
        out.append((n, command))
    return out


def run_sh(block: Block, env: dict[str, str]) -> None:
    commands = sh_commands(block)
    assert commands, f"{block.where}: no command to run"
    for line, command in commands:
        proc = bash(command, env)
        assert proc.returncode == 0, (
            f"{block.doc}:{line}: {command!r} exited {proc.returncode}\n"
            f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
        )


def simulate_help(env: dict[str, str]) -> str:
    proc = bash("kvtier simulate --help", {**env, "COLUMNS": str(HELP_COLUMNS)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def check_options(block: Block, env: dict[str, str]) -> None:
    shown = simulate_help(env)
    assert "\noptions:\n" in shown, shown
    printed = shown[shown.index("\noptions:\n") + 1 :]
    assert block.text == printed, (
        f"{block.where}: the options block is not what `kvtier simulate --help` prints "
        f"at COLUMNS={HELP_COLUMNS}; paste it again from:\n{printed}"
    )


def check_usage(block: Block, env: dict[str, str]) -> None:
    shown = simulate_help(env)
    usage = " ".join(shown.split("\n\n", 1)[0].split())
    words = block.text.split()
    prog = " ".join(w for w in words if not w.startswith("["))
    assert usage.startswith(f"usage: {prog} "), usage
    rest = usage.removeprefix(f"usage: {prog} ")
    for word in words:
        if word.startswith("[") and word != "[options]":
            # the README writes placeholders in capitals, argparse a positional's own name
            found = [w for w in rest.split() if w.lower() == word.lower()]
            assert found, f"{word} is not an optional positional in: {usage}"
            rest = rest.replace(found[0], "")
    while re.search(r"\[[^\[\]]*\]", rest):  # drop optional items, innermost first
        rest = re.sub(r"\[[^\[\]]*\]", "", rest)
    assert not rest.strip(), f"--help's usage has more than optional options: {rest!r}"


def output_checker(block: Block) -> Callable[[Block, dict[str, str]], None] | None:
    if block.lang:
        return None
    if block.text.startswith("options:\n"):
        return check_options
    if re.fullmatch(r"kvtier simulate( \[[A-Za-z]+\])+\n", block.text):
        return check_usage
    return None


def check_kv_transfer_config(block: Block, env: dict[str, str]) -> None:
    import json

    config = json.loads(block.text)
    if config["kv_connector"] == "OffloadingConnector":
        check_offloading_config(config)
        return
    assert config["kv_connector"] == "KVTierConnector", f"{block.where}"
    module = pytest.importorskip(config["kv_connector_module_path"])
    module.connector_config(config["kv_connector_extra_config"], block_size=16, environ=env)
    pytest.importorskip("vllm")  # the connector class is imported with vLLM
    assert hasattr(module, config["kv_connector"])


def check_offloading_config(config: dict[str, Any]) -> None:
    """vLLM's own offloading with kvtier's cache policy: vLLM resolves the policy it names, a
    ``CachePolicy``, and the CPU tier has bytes; each secondary tier it names resolves to a
    ``SecondaryTierManager``, kvtier's with keys that make a valid config of its tiers."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvtier.integrations.vllm import connector_config

    extra = config["kv_connector_extra_config"]
    assert int(extra["cpu_bytes_to_use"]) > 0
    policy = CachePolicyFactory.get_cache_policy_cls(
        extra["eviction_policy"], extra.get("cache_policy_module_path")
    )
    assert issubclass(policy, CachePolicy)
    OffloadingSpecFactory.get_spec_cls(extra)  # a spec vLLM knows
    for tier in extra.get("secondary_tiers", []):
        assert issubclass(SecondaryTierFactory.get_tier_class(tier), SecondaryTierManager)
        if tier["type"] == "KvtierTier":
            own = {"type", "module_path", "attention_backend", "head_dim"}
            connector_config({k: v for k, v in tier.items() if k not in own}, block_size=16)


#: Runs a command with every argparse parser stopping it once it has parsed a command line that
#: hands nothing on (no ``REMAINDER`` words, its own or its subcommands', left for another
#: parser): exit status 0 then, argparse's 2 on a bad option.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_known_args
def remainders(parser):
    for action in parser._actions:
        if action.nargs == argparse.REMAINDER:
            yield action.dest
        for sub in (action.choices or {}).values() if action.nargs == argparse.PARSER else ():
            yield from remainders(sub)
def parse_only(self, args=None, namespace=None):
    parsed = parse(self, args, namespace)
    if not any(getattr(parsed[0], dest, None) for dest in remainders(self)):
        raise SystemExit(0)
    return parsed
argparse.ArgumentParser.parse_known_args = parse_only
sys.argv = sys.argv[1:]
if sys.argv[0] == "kvtier":
    from kvtier.cli import main
    raise SystemExit(main(sys.argv[1:]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def console_commands(block: Block) -> list[tuple[int, list[str]]]:
    """``(line, argv)`` of each command of a ``console`` block: continuations joined, leading
    ``VAR=value`` words, a redirection and comments dropped, ``python`` itself too."""
    out: list[tuple[int, list[str]]] = []
    pending, first = "", 0
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            first = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]
            continue
        command, pending = (pending + line).split(" #", 1)[0].strip(), ""
        if not command:
            continue
        words = shlex.split(command.split(">", 1)[0])
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)
        if words[0] in ("python", "python3"):
            words.pop(0)
        out.append((first, words))
    return out


def check_console(block: Block, env: dict[str, str]) -> None:
    commands = console_commands(block)
    assert commands, f"{block.where}: no command to check"
    for line, argv in commands:
        assert argv[0] == "kvtier" or argv[0].startswith("benchmarks/"), (
            f"{block.doc}:{line}: a console block holds kvtier or benchmarks/ commands: {argv}"
        )
        proc = bash(shlex.join([sys.executable, "-c", PARSE_ONLY, *argv]), env, timeout=180)
        assert proc.returncode == 0, (
            f"{block.doc}:{line}: {shlex.join(argv)} is not a command line it takes "
            f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )


def json_keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in json_keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in json_keys(v)}
    return set()


def check_schema(block: Block, env: dict[str, str]) -> None:
    import json

    proc = bash(
        "kvtier simulate --limit 300 --device-blocks 50 --no-progress --json "
        "--compare lru,importance,optimal,vllm-lru",
        env,
    )
    assert proc.returncode == 0, proc.stderr
    named = set(re.findall(r'"(\w+)":', block.text))
    missing = named - json_keys(json.loads(proc.stdout))
    assert not missing, f"{block.where}: the schema names keys no result has: {sorted(missing)}"


def check_mermaid(block: Block, env: dict[str, str]) -> None:
    assert block.text.split(None, 1)[0] in ("flowchart", "graph"), block.where


BLOCK_CHECKS: dict[str, Callable[[Block, dict[str, str]], None]] = {
    "console": check_console,
    "schema": check_schema,
    "mermaid": check_mermaid,
}


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in BLOCKS])
def test_readme_block(
    block: Block, request: pytest.FixtureRequest, clean_env: dict[str, str]
) -> None:
    if block.lang == "python":
        run_python(block, request)
    elif block.lang in SH_LANGS:
        run_sh(block, clean_env)
    elif block.lang == "json":
        check_kv_transfer_config(block, clean_env)
    elif block.lang in BLOCK_CHECKS:
        BLOCK_CHECKS[block.lang](block, clean_env)
    else:
        check = output_checker(block)
        assert check is not None, (
            f"{block.where}: no rule runs or checks this ```{block.lang} block; "
            "add one to tests/test_readme.py"
        )
        check(block, clean_env)


def test_the_readme_has_blocks_of_each_kind() -> None:
    # A parser that finds nothing would pass everything.
    kinds = [b.lang for b in BLOCKS]
    assert kinds.count("python") >= 4
    assert kinds.count("sh") >= 1
    assert sum(output_checker(b) is not None for b in BLOCKS) == 2


def test_every_substitution_has_its_block() -> None:
    """A rule whose heading lost its python block would otherwise never be checked."""
    for sub in SUBSTITUTIONS:
        assert any(b.lang == "python" and b.heading.startswith(sub.section) for b in BLOCKS), (
            f"no python block under a heading starting {sub.section!r} for {sub.old!r}"
        )


def test_rules_parse_and_skip_as_documented() -> None:
    block = Block(1, "sh", "x", "make test   # all\n\nmake simulate  # replay\nls -d python\n")
    assert sh_commands(block) == [(4, "make -o develop simulate"), (5, "ls -d python")]
    assert free_names("import numpy as np\nx = np.arange(n)\nfor i in x: f(i, y=k)\n") == [
        "f",
        "k",
        "n",
    ]
    # a rule whose text left the block is reported, not silently skipped
    moved = Block(1, "python", "BlockManager: moved", "bm = BlockManager(device='cpu')\n")
    assert substituted(moved, {})[1] == substitutions_for(moved) != []
    console = Block(
        1,
        "console",
        "x",
        "A=1 kvtier eval x \\\n  --y 2 > out.json  # long\npython benchmarks/b.py\n",
    )
    assert console_commands(console) == [
        (2, ["kvtier", "eval", "x", "--y", "2"]),
        (4, ["benchmarks/b.py"]),
    ]
    text = "# t\n\n## A `b`\n\n```python\nx = 1\n```\n\n```\nplain\n```\n"
    assert readme_blocks(text) == [
        Block(5, "python", "A b", "x = 1\n"),
        Block(9, "", "A b", "plain\n"),
    ]
