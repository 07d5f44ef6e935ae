"""What `dflash benchmark` runs on: its config, the target/draft/tokenizer, drafters, prompts.

Real models load through mlx-lm and our draft loader; `--random-target` shapes are built in memory
with random weights (no files, no downloads) so speed can be measured on any machine. The oracle
drafters live here too: they decide what "ceiling" means (see docs/benchmark.md).
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import draftvocab
from ..draft import DFlashDraft, DraftConfig, read_config
from ..drafters import DFlashDrafter, Drafter, OracleDrafter
from ..loading import DTYPES, draft_dtype, floating_dtypes, main_dtype, resolve_model
from ..target import TargetModel, default_layer_ids

# Named shapes for --random-target (public architecture numbers of the Qwen3 family).
_QWEN3 = dict(
    model_type="qwen3",
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    vocab_size=151936,
)
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=12288, tie_word_embeddings=False),
    "tiny": {},  # engine.tiny's qwen3 config, vocab = the tiny tokenizer's
}


# --- configuration ------------------------------------------------------------------------------
# Results go under the directory the user runs from, never into the installed package's tree.
DEFAULT_OUT = "benchmark-results"


@dataclass
class BenchConfig:
    """Every knob of one benchmark run; written verbatim into the JSON."""

    model: str | None = None
    draft: str | None = None
    random_target: str | None = None
    draft_layers: int = 5  # random target only; 0 = no draft
    block_size: int = 16  # when no draft fixes it (oracle without draft)
    oracle: bool = False
    oracle_draft_cost: bool = True  # oracle mode: still run the draft (its cost), discard its ids
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    max_tokens: int = 256
    repeats: int = 3
    warmup: int = 1
    # warm up on the built-in text cut to this many tokens, not on each row's prompt (0: the row's
    # prompt): with --chat, one question and one repeat a process, the timed runs are first-time
    warmup_context: int = 0
    cooldown: float = 5.0
    dtype: str | None = None
    out: str = DEFAULT_OUT
    prompt_file: str | None = None
    chat: bool = False  # prompts = chat questions through the template, not text cut to contexts
    label: str | None = None
    respect_eos: bool = False
    verify_iters: int = 10
    verify_window: str = "auto"  # oracle mode always verifies the full block
    copy_draft: bool = True  # copy drafting beside the draft (engine/lookup.py); off in oracle mode
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # 0 = greedy
    top_p: float = 1.0  # sampling only; 1 = off
    top_k: int = 0  # sampling only; 0 = off
    min_p: float = 0.0  # sampling only; 0 = off
    min_tokens_to_keep: int = 1  # sampling with min_p: the tokens min-p always keeps
    first_time_lengths: bool = True  # every timed run at cache lengths new to the process
    process_per_run: bool = False  # --chat: each repeat of each question in its own process (apart.py)
    seed: int = 0  # random prompt ids, random weights, sampling draws
    plot: bool = True

    @property
    def mode(self) -> str:
        return "oracle" if self.oracle else "dflash"


@dataclass
class Setup:
    """What the runs need: the target (with capture), a drafter factory and a tokenizer."""

    target: TargetModel
    tokenizer: Any
    name: str
    dtype: str
    draft_model: DFlashDraft | None
    block_size: int
    random_prompts: bool  # random target: prompt ids are random ids in range
    description: str
    decisive: bool = False  # random target made decisive for the oracle (make_decisive)
    draft_vocab: list[int] | None = None  # the ids the draft may propose (draftvocab; None: all)


# --- building the target / draft ----------------------------------------------------------------
def _randomize(module: Any, dtype: mx.Dtype, std: float, seed: int) -> None:
    """Replace every weight with small normal noise (norm scales: ones), materialised per tensor.

    The constructor's own lazy initialisers are never evaluated, so an 8B-shape model costs
    only its final bf16 bytes.
    """
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    weights = []
    for name, p in tree_flatten(module.parameters()):
        if p.ndim == 1:
            w = mx.ones(p.shape, dtype=dtype)
        else:
            w = mx.random.normal(p.shape, dtype=dtype, scale=std)
        mx.eval(w)
        weights.append((name, w))
    module.load_weights(weights, strict=True)


class _IdDetokenizer:
    """Streaming detokenizer for random targets: any id renders as a fixed piece of text.

    A random 151936-id target emits ids the tiny tokenizer does not have; mapping id modulo the
    tokenizer's size keeps text cheap (O(1) per token) and identical for both engines.
    """

    def __init__(self, tokenizer: Any):
        n = len(tokenizer)
        self._pieces = [tokenizer.decode([i]) for i in range(n)]
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens: list[int] = []
        self.text = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.text += self._pieces[token % len(self._pieces)]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        seg = self.text[self.offset :]
        self.offset = len(self.text)
        return seg


def _tiny_tokenizer() -> Any:
    """engine.tiny's byte-level BPE (built in a temp dir), wrapped like mlx-lm wraps tokenizers."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from ..tiny import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="dflash-bench-tok-") as d:
        build_tokenizer(Path(d))
        hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(d) / "tokenizer.json"))
    hf.eos_token = "<|im_end|>"
    return TokenizerWrapper(hf, detokenizer_class=_IdDetokenizer)


def random_shape_config(shape: str, vocab_size: int | None = None) -> dict:
    """The mlx-lm config a named random shape builds: its own, or (an empty entry) the tiny
    qwen3's, with `vocab_size` when given (the tiny tokenizer's, for a model to run)."""
    from ..tiny import ARCH_CONFIGS

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    if RANDOM_SHAPES[shape]:
        return dict(RANDOM_SHAPES[shape])
    cfg = dict(ARCH_CONFIGS["qwen3"])
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def random_target(shape: str, dtype: mx.Dtype, seed: int = 0) -> tuple[Any, Any, dict]:
    """A random-weight mlx-lm model of a named shape, built in memory; returns (model, tok, cfg)."""
    from mlx_lm.utils import _get_classes

    tok = _tiny_tokenizer()
    cfg = random_shape_config(shape, vocab_size=len(tok))
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    _randomize(model, dtype, std=0.02, seed=seed)
    model.eval()
    return model, tok, cfg


DECISIVE_TOKEN = 7


def make_decisive(model: Any, token: int = DECISIVE_TOKEN, strength: float = 1000.0) -> None:
    """Make a random target's greedy choice `token` everywhere, by a wide margin.

    For the oracle at first-time lengths: a random-weight model's logits are near-ties, so in
    bf16 a 16-token verify and a 1-token step pick different argmaxes within a few dozen tokens
    and the replayed reference stops being accepted (same-prompt settling is not possible when
    no length may be re-run). Every embedding gets a large constant in feature 0, which the
    residual stream carries to the final norm; the LM head row of `token` reads that feature.
    Shapes, dtypes and the work per token are unchanged: only which token wins, and by how much.
    """
    from ..target import _find_text_model

    outer, inner = _find_text_model(model)
    emb = inner.embed_tokens.weight
    col = mx.zeros((emb.shape[1],), emb.dtype).at[0].add(1.0)
    inner.embed_tokens.weight = emb * (1 - col) + col * strength
    if "lm_head" in outer:
        head = outer.lm_head.weight
        outer.lm_head.weight = head.at[token, 0].add(1.0)
    else:  # tied: the embedding is the head; its row `token` reads feature 0 twice as strongly
        w = inner.embed_tokens.weight
        inner.embed_tokens.weight = w.at[token, 0].add(strength)
    mx.eval(model.parameters())


def random_draft(
    target_cfg: dict, layer_ids: list[int], num_layers: int, block_size: int, dtype: mx.Dtype,
    seed: int = 1,
) -> DFlashDraft:
    """A random DFlash draft shaped like the published ones for this target (speed only)."""
    cfg = DraftConfig(
        hidden_size=target_cfg["hidden_size"],
        num_hidden_layers=num_layers,
        intermediate_size=target_cfg["intermediate_size"],
        num_attention_heads=target_cfg["num_attention_heads"],
        num_key_value_heads=target_cfg["num_key_value_heads"],
        head_dim=target_cfg["head_dim"],
        vocab_size=target_cfg["vocab_size"],
        target_layer_ids=layer_ids,
        mask_token_id=target_cfg["vocab_size"] - 1,
        block_size=block_size,
        rope_theta=float(target_cfg["rope_theta"]),
        num_target_layers=target_cfg["num_hidden_layers"],
        max_position_embeddings=target_cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(target_cfg.get("tie_word_embeddings", False)),
    )
    draft = DFlashDraft(cfg)
    _randomize(draft, dtype, std=0.02, seed=seed)
    draft.eval()
    return draft


def default_dtype_name() -> str:
    """bf16 on an accelerator; fp32 on CPU, where only fp32 goes through a fast BLAS."""
    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def check_contexts(cfg: BenchConfig) -> None:
    """Refuse a prompt length plus --max-tokens past the target's declared context (its config,
    read before the weights load): past it a run times positions the model was never trained
    on, and --contexts 10000000 was taken and run. A config that declares no context refuses
    nothing."""
    from ..generate import config_context_tokens

    lengths = [("--warmup-context", cfg.warmup_context)] if cfg.warmup_context else []
    if not cfg.chat:
        lengths.append(("--contexts", max(cfg.contexts, default=0)))
    if not lengths:
        return
    if cfg.random_target:
        if cfg.random_target not in RANDOM_SHAPES:
            return  # random_target names the known shapes
        tcfg = random_shape_config(cfg.random_target)
        name = f"--random-target {cfg.random_target}"
    elif cfg.model:
        tcfg = json.loads((Path(resolve_model(cfg.model)) / "config.json").read_text())
        name = f"model {cfg.model}"
    else:
        return
    limit = config_context_tokens(tcfg)
    for option, n in lengths:
        if limit and n + cfg.max_tokens > limit:
            raise ValueError(f"{option} {n} + --max-tokens {cfg.max_tokens} = {n + cfg.max_tokens} "
                             f"tokens is past {name}'s context of {limit} tokens: give shorter "
                             f"{option} or fewer --max-tokens")


def build_setup(cfg: BenchConfig) -> Setup:
    """Load or build the target, the draft (if any) and the tokenizer for this config."""
    from ..draft import load_draft

    if cfg.random_target:
        dname = cfg.dtype or default_dtype_name()
        model, tok, tcfg = random_target(cfg.random_target, DTYPES[dname], cfg.seed)
        n = tcfg["num_hidden_layers"]
        layer_ids = default_layer_ids(n, 5)
        draft = None
        if cfg.draft_layers > 0 and not (cfg.oracle and not cfg.oracle_draft_cost):
            draft = random_draft(tcfg, layer_ids, cfg.draft_layers, cfg.block_size, DTYPES[dname],
                                 seed=cfg.seed + 1)  # seed 0: the draft every earlier result ran
        desc = (f"random-weight {cfg.random_target} target "
                f"({n} layers, hidden {tcfg['hidden_size']})")
        if draft is not None:
            desc += f", random {cfg.draft_layers}-layer draft"
        decisive = cfg.oracle and cfg.first_time_lengths
        if decisive:  # the replayed reference must survive bf16 verify-vs-step rounding
            make_decisive(model)
            desc += f", decisive (greedy token {DECISIVE_TOKEN} by a wide margin, for the oracle)"
        return Setup(TargetModel(model, layer_ids), tok, f"random-{cfg.random_target}", dname,
                     draft, cfg.block_size, True, desc, decisive)
    if not cfg.model:
        raise ValueError("--model (or --random-target) is required")
    local = resolve_model(cfg.model)  # a clear error for a missing model, before any draft's
    if not cfg.oracle and not cfg.draft:
        from ..registry import resolve_draft

        cfg.draft = str(resolve_draft(cfg.model, model_dir=local))  # clear error when no draft is known
    from ..loading import load_target

    model, tok = load_target(local, cfg.model)  # a damaged folder said in one line
    if cfg.dtype:
        model.set_dtype(DTYPES[cfg.dtype])
    draft = None
    if cfg.draft and not (cfg.oracle and not cfg.oracle_draft_cost):
        draft = load_draft(cfg.draft, draft_dtype(model, cfg.dtype))
    if draft is not None:
        layer_ids, block = list(draft.config.target_layer_ids), draft.config.block_size
    elif cfg.draft:  # oracle without draft cost: the draft only fixes layers and block size
        dcfg = read_config(cfg.draft)  # as load_draft reads and names it
        layer_ids, block = list(dcfg.target_layer_ids), dcfg.block_size
    else:
        layer_ids, block = None, cfg.block_size
    if layer_ids is None:  # no draft: capture like a 5-layer published draft would
        layer_ids = default_layer_ids(TargetModel(model, []).num_layers, 5)
    target = TargetModel(model, layer_ids)
    dname = cfg.dtype or _main_dtype(model)
    desc = f"{cfg.model}" + (f" + draft {cfg.draft}" if draft is not None else "")
    vocab = draftvocab.choose(cfg.draft, target.vocab_size) if draft is not None else None
    if vocab:
        desc += f" (draft vocabulary: {draftvocab.describe(len(vocab))})"
    return Setup(target, tok, Path(cfg.model).name, dname, draft, block, False, desc,
                 draft_vocab=vocab)


def _main_dtype(model: Any) -> str:
    """The floating dtype holding most weights (quantized models also carry uint32 packs)."""
    _, packed = floating_dtypes(model)
    return (main_dtype(model) or "unknown") + (" + quantized weights" if packed else "")


class CostedOracleDrafter:
    """Oracle proposals, but the real draft still runs every cycle (its cost stays in the timing).

    The draft's ids enter the proposal as `oracle + 0 * draft`, so lazy evaluation cannot skip
    the draft's forward pass; the proposals are exactly the oracle's.
    """

    def __init__(self, oracle: OracleDrafter, draft: DFlashDrafter):
        self.oracle, self.draft = oracle, draft
        self.block_size = oracle.block_size
        self.layer_ids = draft.layer_ids

    def reset(self, *args: Any, **kwargs: Any) -> None:
        self.oracle.reset(*args, **kwargs)
        self.draft.reset(*args, **kwargs)

    def jump(self, position: int) -> None:
        self.oracle.jump(position)
        self.draft.jump(position)

    def add_context(self, features: mx.array) -> None:
        self.draft.add_context(features)

    def propose(self, anchor: mx.array, anchor_pos: int, count: int | None = None) -> mx.array:
        return self.oracle.propose(anchor, anchor_pos, count) + 0 * self.draft.propose(anchor, anchor_pos, count)


def make_drafter(setup: Setup, cfg: BenchConfig, reference: list[int], prompt_len: int) -> Drafter:
    """The drafter for one DFlash run: the real draft, or the oracle over `reference`."""
    real = (DFlashDrafter(setup.draft_model, setup.target, setup.draft_vocab)
            if setup.draft_model is not None else None)
    if not cfg.oracle:
        if real is None:
            raise ValueError("DFlash mode needs a draft (give --draft, or --draft-layers > 0)")
        return real
    oracle = OracleDrafter(
        reference, prompt_len, setup.block_size,
        layer_ids=setup.target.layer_ids, vocab_size=setup.target.vocab_size,
    )
    return CostedOracleDrafter(oracle, real) if real is not None else oracle


# --- prompts ------------------------------------------------------------------------------------
def prompt_text(cfg: BenchConfig) -> str | None:
    """--prompt-file's text, read before any model loads: an empty file (with --chat: one without
    a question) is refused, never silently replaced by the built-in prompts."""
    from ..prompting import prompt_lines

    if not cfg.prompt_file:
        return None
    try:
        text = Path(cfg.prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {cfg.prompt_file} cannot be read: {e}") from e
    if not text.strip():
        raise ValueError(f"--prompt-file {cfg.prompt_file} is empty")
    if cfg.chat:
        try:  # a malformed JSON line is named now, not after the setup
            prompt_lines(text)
        except ValueError as e:  # which file, as the training readers say it
            raise ValueError(f"--prompt-file {cfg.prompt_file}: {e}") from None
    return text


def prompt_ids(setup: Setup, length: int, text: str | None, seed: int) -> list[int]:
    """Exactly `length` prompt ids: random ids for a random target, else text repeated/trimmed."""
    if setup.random_prompts and text is None:
        rng = random.Random(seed * 1_000_003 + length)
        return [rng.randrange(setup.target.vocab_size) for _ in range(length)]
    return text_prompt_ids(setup.tokenizer, length, text)


def text_prompt_ids(tok: Any, length: int, text: str | None = None) -> list[int]:
    """Exactly `length` ids of raw text (`text`, else the built-in prose) after the BOS token,
    the text repeated as often as it takes: the benchmark's `--contexts` prompts."""
    body = list(tok.encode(BUILTIN_TEXT if text is None else text, add_special_tokens=False))
    if not body:
        raise ValueError("the prompt text encodes to no tokens")
    bos = getattr(tok, "bos_token_id", None)
    head = [bos] if bos is not None else []
    ids = list(head)
    while len(ids) < length:
        ids.extend(body)
    return ids[:length]


def chat_questions(text: str | None) -> list[str]:
    """The questions: a line of `text` each (plain, or JSONL with "prompt" as the held-out sets
    are), or the built-in ones."""
    from ..prompting import prompt_lines

    questions = CHAT_QUESTIONS if text is None else [q for _, q in prompt_lines(text)]
    if not questions:
        raise ValueError("the prompt file has no questions")
    return questions


def chat_prompts(setup: Setup, text: str | None) -> list[list[int]]:
    """One prompt per question (chat_questions) through the chat template."""
    from ..prompting import build_prompt

    if setup.random_prompts:
        raise ValueError("--chat needs a real model with a tokenizer (not --random-target)")
    return [build_prompt(setup.tokenizer, q) for q in chat_questions(text)]


# Everyday assistant questions of the kinds the default draft is trained on (chat, code, math,
# explanation, story); none is in its training prompts.
CHAT_QUESTIONS = [
    "What are three simple ways to drink more water during the day?",
    "Write a Python function that returns the second largest number in a list.",
    "A recipe needs 3 eggs for 12 cookies. How many eggs do I need for 30 cookies?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a snail who wants to see the ocean.",
]


# --- built-in prompt text -----------------------------------------------------------------------
# Original prose on mixed topics, written for this benchmark; repeated to reach long contexts.
BUILTIN_TEXT = """\
The harbour woke before the town did. Long before the bakery lit its ovens, the fishing boats
were already easing away from the stone quay, their engines muttering in the grey light, gulls
wheeling above them in slow, hopeful circles. Maria had watched this from her window for almost
forty years, and she still could not say exactly which moment counted as morning. Was it the
first engine, or the first gull, or the first square of light on the water beyond the breakwater?
Her late husband used to insist it was the smell of diesel and salt, which arrived a few minutes
after the boats had gone and lingered until the bread came out.

A lighthouse keeper's log from the last century survives in the town museum. Most entries are
brief: wind direction, visibility, the number of vessels sighted, the oil consumed by the lamp.
But every few pages the keeper allowed himself a sentence of his own. "Heavy swell, and the cat
refuses to leave the stove." "Fog so thick the bell seemed to ring inside the room." "Saw the
northern lights for the third night running; wrote to my sister about them, though she will not
believe me." Reading those lines, one gets the sense of a patient man who measured his life in
small, exact observations, and who found in that exactness a kind of company.

Consider, for a moment, how a river finds its way to the sea. No single drop of water knows the
route. Each one simply moves downhill, pushed by gravity and turned aside by rock, sand and the
roots of trees. Over thousands of years these countless small decisions carve valleys, build
deltas and shape the places where people choose to live. Engineers who design drainage systems
for cities study the same principle at a smaller scale: water will always take the path of least
resistance, so the art lies in making the desired path the easiest one.

In the kitchen, timing matters more than most recipes admit. Onions need patience; rushed over a
high flame they turn bitter instead of sweet. Garlic burns in seconds, so it goes in late. Pasta
water should taste of the sea, and a cup of it saved before draining will rescue a sauce that has
grown too thick. Bread dough tells you when it is ready if you press it gently with a floured
finger: the dent should spring back slowly, not at once and not at all. None of this is secret,
yet each lesson seems to be learned properly only after it has been ignored once.

Mathematics offers a different kind of patience. A proof may take an afternoon to read and a
month to understand. The statement that there are infinitely many prime numbers can be shown in a
few lines: suppose the list were finite, multiply every prime on it together and add one, and the
result is divisible by none of them. Either it is prime itself or it has a prime factor missing
from the list. The argument is more than two thousand years old and has lost none of its charm,
because it turns an impossible task, checking every number, into a single clever construction.

Computers, for all their speed, still wait on memory. A modern processor can perform many
operations in the time it takes to fetch one value from main memory, which is why programs that
read data in long contiguous runs often beat cleverer programs that jump around. Large language
models make this trade-off vivid: generating one token at a time means reading every weight of
the model for each token, so the arithmetic units sit mostly idle while the memory bus does the
work. Checking several proposed tokens in a single pass reuses each weight many times and puts the
idle arithmetic to use, which is the whole idea behind speculative decoding.

The village school had only two classrooms, and the older children took turns helping the younger
ones with their reading. On rainy afternoons the teacher pushed the desks against the walls and
taught geography on the floor, with a chalk outline of the continents and paper boats for ships.
Decades later, several of those children could still recite the trade winds and the great ocean
currents, not because they had memorised a list, but because they had once crawled along the Gulf
Stream on their knees, carrying a paper boat from the Caribbean towards the coast of Ireland.

Gardeners speak of the hungry gap, the weeks in early spring when the stored roots have run out
and the new season's crops are not yet ready. It is a reminder that abundance arrives in waves,
and that planning for the lean weeks is as important as enjoying the harvest. Experienced growers
sow in small batches every fortnight rather than all at once, so that lettuces and beans mature in
a steady stream. The same habit serves well in other work: many small, regular efforts tend to
outlast a single heroic push.

When the evening train pulled into the station, the platform was nearly empty. A porter leaned on
his trolley, a woman checked the timetable twice, and a boy with a violin case stood very still,
as if he were afraid that moving would make him miss something. The conductor stepped down, looked
along the carriages, and raised his hand. Somewhere a door slammed, a whistle sounded, and the
train began to move again, slowly at first, then faster, its lit windows sliding past like the
frames of a film until only the red lamp at the end remained, shrinking into the dark.
"""
