"""The seed's phases, and the load each sends, at the seed's size or scaled to a tiny model.

kvcached PR #598's basic case: ``gen_seq`` (9 prompts, 6 short and 300, 900 and 1,800 words of
filler, greedy, 64 output tokens, one at a time), ``gen_conc`` (the same 9 at once), a prefix-cache
reset, ``apc_0``..``apc_2`` (4 questions about one shared 1,300-word document, 32 output tokens, one
at a time), ``apc_conc`` (the 4 at once). The text is generated from a seed, so that every server
of a run, and every run, gets the same bytes; it is plain English words, which real tokenizers and
the tiny models' tokenizer (trained on the same words) both read.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

import msgspec

from kvcached.testing.tiny_model import WORDS
from kvcached.vllm.testing.e2e import Completion


class Scale(msgspec.Struct, frozen=True):
    long_words: tuple[int, ...]  # the filler prompts of gen_seq, in words
    gen_tokens: int
    doc_words: int  # the apc phases' shared document
    apc_tokens: int
    tail_words: int  # apc_reload's text of each question's own, in words (blocks to store)


SEED: Final = Scale(long_words=(300, 900, 1800), gen_tokens=64, doc_words=1300, apc_tokens=32, tail_words=100)
# A tiny model on a CPU: a sixth of the words (its context is 2,048 tokens), outputs of 8 tokens.
TINY: Final = Scale(long_words=(50, 150, 300), gen_tokens=8, doc_words=400, apc_tokens=8, tail_words=150)

SHORT: Final = (
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "List three colours.",
    "Explain what a cache is in one line.",
    "Count from one to ten.",
    "Name a river in Europe.",
)
QUESTIONS: Final = (
    "Question: what is the document about?",
    "Question: which word comes up most often?",
    "Question: summarise the first paragraph.",
    "Question: what would you call this document?",
)
PHASES: Final = ("gen_seq", "gen_conc", "apc_0", "apc_1", "apc_2", "apc_conc", "apc_reload")
RESET_BEFORE: Final = ("apc_0", "apc_reload")
# The phases compared with native: the seed's, and the reload (its cached tokens are CPU-tier hits).
COMPARED: Final = ("gen_seq", "apc_0", "apc_1", "apc_2", "apc_reload")


class Client(Protocol):
    def complete(self, prompt: str, max_tokens: int, *, logprobs: int = 5) -> Completion: ...
    def reset_prefix_cache(self) -> bool: ...


def filler(words: int, seed: str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def load(scale: Scale) -> dict[str, list[tuple[str, int]]]:
    """Each phase's (prompt, max_tokens) pairs."""
    gen = [(p, scale.gen_tokens) for p in SHORT]
    gen += [(f"{filler(n, f'filler {n}')}\n\nSummarise the text above.", scale.gen_tokens) for n in scale.long_words]
    doc = filler(scale.doc_words, "document")
    apc = [(f"{doc}\n\n{q}", scale.apc_tokens) for q in QUESTIONS]
    own = [f"{doc}\n\n{filler(scale.tail_words, f'tail {i}')}\n\n{q}" for i, q in enumerate(QUESTIONS)]
    reload = [(p, 1) for p in own] + apc
    return {
        "gen_seq": gen,
        "gen_conc": gen,
        "apc_0": apc,
        "apc_1": apc,
        "apc_2": apc,
        "apc_conc": apc,
        "apc_reload": reload,
    }


def run(server: Client, scale: Scale) -> tuple[dict[str, list[Completion]], bool]:
    """The phases in order: their completions, and whether every reset was accepted."""
    prompts = load(scale)
    out: dict[str, list[Completion]] = {}
    resets: list[bool] = []
    for phase in PHASES:
        if phase in RESET_BEFORE:
            resets.append(server.reset_prefix_cache())
        pairs = prompts[phase]
        if phase.endswith("_conc"):
            with ThreadPoolExecutor(len(pairs)) as pool:
                out[phase] = list(pool.map(lambda pn: server.complete(*pn), pairs))
        else:
            out[phase] = [server.complete(p, n) for p, n in pairs]
    return out, all(resets)
