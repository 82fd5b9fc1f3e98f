"""Training data for a draft head, made on this machine without any download.

Prompts: code tasks built from the Python standard library's own functions (signature and
docstring, in the format of the HumanEval benchmark prompts, whose functions they are not), and
open-ended chat requests from specdec's own templates and topics (none of them the benchmark's
chat prompts). The target answers each one (self-distillation: the head learns the text the target
itself writes), and `harvest` keeps every position's token and final hidden state.
Held out: `specdec bench`'s prompt sets (HumanEval, the chat set) are never trained on.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydoc_data.topics import topics as PYTHON_REFERENCE
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.rejection import inverse_cdf

MAX_PROMPT = 1024  # longer training prompts are skipped (the KV cache is sized for this)
CORPUS_WINDOW = 512  # tokens per teacher-forced corpus chunk

CHAT_TEMPLATES = [
    "Explain {t} to a curious teenager.",
    "What are the most common misconceptions about {t}?",
    "Write a short poem about {t}.",
    "Give me five practical tips related to {t}.",
    "Describe the history of {t} in a few paragraphs.",
    "What would a beginner need to know about {t}?",
    "Write a short story in which {t} plays an important role.",
    "Compare {t} with something similar and explain the differences.",
    "Why is {t} important? Answer in a short essay.",
    "Write a blog post introduction about {t}.",
    "Summarise the pros and cons of {t}.",
    "How would you teach {t} to a group of children?",
    "Write a friendly letter to a friend telling them about {t}.",
    "List some interesting facts about {t} and explain each one.",
    "What questions should I ask an expert on {t}?",
    # (the forms people ask in: why and how questions, requests for ideas, messages, plans)
    "How does {t} work?",
    "Why do people care so much about {t}?",
    "What is {t}, in simple terms?",
    "Can you give me a quick overview of {t}?",
    "I'm writing a school report on {t}. Where should I start?",
    "What are three surprising things about {t}?",
    "Write a short email to my team sharing a fun fact about {t}.",
    "Write a text message inviting a friend to an event about {t}.",
    "Give me an idea for a weekend project involving {t}.",
    "What is the difference between {t} and {u}?",
    "How are {t} and {u} connected?",
    "Describe a typical day for someone who works with {t}.",
    "What mistakes do people often make with {t}?",
    "Tell me a joke about {t}, then explain why it is funny.",
    "Write a haiku about {t}.",
    "Write a product description for a book about {t}.",
    "Summarise the plot of a novel you would write about {t}.",
    "What will {t} look like in fifty years?",
    "Give me a step-by-step plan to learn about {t} in one month.",
    "What are good habits for someone interested in {t}?",
    "Describe {t} to someone who has never heard of it.",
    "Write a dialogue between two friends arguing about {t}.",
    "What is the most important thing to understand about {t}?",
    "Write a motivational speech that mentions {t}.",
    "What are some good questions for a quiz about {t}?",
    "Explain {t} using an everyday analogy.",
    "Write a diary entry from someone who just discovered {t}.",
    "Is {t} overrated? Give both sides.",
    "What should a tourist know about {t}?",
    "Write a short news report about a new discovery related to {t}.",
    "Give me a checklist for getting started with {t}.",
    "How has {t} changed over the last century?",
    "Write a limerick about {t}.",
    "What are the environmental effects of {t}?",
    "Describe {t} in exactly three sentences.",
]

CHAT_TOPICS = [  # none the subject of a benchmark chat prompt (those are held out)
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon landing",
    "honey bees", "compound interest", "learning a new language", "jazz music", "the Roman empire",
    "sleep hygiene", "electric cars", "recycling plastic", "coral reefs", "chess openings",
    "the printing press", "earthquakes", "public speaking", "meditation", "gardening in small spaces",
    "the human heart", "renewable energy", "ancient Egypt", "mountain hiking", "bread baking",
    "time management", "the internet", "dinosaurs", "the stock market", "migratory birds",
    "friendship", "minimalism", "space telescopes", "tea ceremonies", "rainforests",
    "the Olympic games", "origami", "bicycles", "running a marathon", "city parks",
    "deserts", "the periodic table", "impressionist painting", "saving money", "octopuses",
    "trains", "volunteering", "solar panels", "the ocean tides", "board games",
    "the French revolution", "camping", "penguins", "the immune system's white blood cells",
    "wind turbines", "classical music", "journaling", "libraries", "coffee", "snow",
    "the brain", "kindness", "museums", "robots", "pizza", "elephants", "rivers", "bridges",
    "music festivals", "job interviews", "moving to a new city", "healthy breakfasts",
    "video games", "podcasts", "birdwatching", "the solar system", "pottery", "yoga",
    "farming", "the Silk Road", "submarines", "glaciers", "hot air balloons", "pirates",
    "wolves", "tornadoes", "the Great Wall of China", "writing a resume", "teamwork",
    "smartphones", "knitting", "astronauts", "fossils", "the rule of law", "democracy",
    "artificial intelligence", "rainbows", "photography", "skateboarding", "canals",
    "mushrooms", "the Renaissance", "budget travel", "houseplants", "thunderstorms", "the Moon's phases",
    "honeycomb structures", "street food", "sign language", "lightning", "the Amazon river", "owls",
    "cheese making", "handwriting", "magnets", "the Vikings", "family dinners", "electric guitars",
    "hot springs", "composting", "nuclear power", "sourdough", "the Sahara", "sharks",
    "cloud computing", "opera", "first aid", "bees and flowers", "the metric system", "waterfalls",
    "carpentry", "the Northern Lights", "baseball", "tides and the Moon", "spiders", "glassblowing",
    "quantum computers", "tulips", "dog training", "chocolate", "the Arctic", "kites",
    "ancient Greece", "hydroelectric dams", "poetry slams", "traffic lights", "sea turtles", "maps",
    "the Industrial Revolution", "cooking with spices", "mindfulness at work", "jellyfish", "umbrellas",
    "the speed of light", "sand dunes", "space stations", "comic books", "clocks", "hiking boots",
    "the Internet of Things", "wildfires", "bamboo", "ballet", "the postal service", "frogs",
    "3D printing", "ice cream", "mountains", "the Amazon rainforest's animals", "calligraphy",
    "rock climbing", "the human skeleton", "salt", "caves", "email etiquette", "whales", "castles",
    "electric bicycles", "windmills", "the history of money", "paper", "soccer", "ferries",
    "rivers and floods", "stars", "typewriters", "gratitude", "the Pacific Ocean", "cacti",
    "urban gardening", "remote work", "ants", "volcanic islands", "the telescope", "cookbooks",
]


def chat_prompts() -> list[str]:
    """Every template with every topic ({u}: a second topic, a fixed stride away)."""
    n = len(CHAT_TOPICS)
    return [t.format(t=topic, u=CHAT_TOPICS[(i + 37) % n]) for i, topic in enumerate(CHAT_TOPICS)
            for t in CHAT_TEMPLATES]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
            if not ("test" in p.parts[-2:][0] or p.name.startswith("test"))]


def code_prompts(limit: int | None = None) -> list[str]:
    """'Complete this Python function' tasks: each a standard-library function's or public
    method's signature and docstring (docstrings of 2+ lines), HumanEval's format."""
    out = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and (code := _stub(node, "")):
                out.append(code)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out += [f"class {node.name}:\n{code}" for f in node.body
                        if isinstance(f, ast.FunctionDef) and (code := _stub(f, "    "))]
    return [f"Complete this Python function. Reply with code only.\n\n```python\n{c}```"
            for c in (out[:limit] if limit else out)]


def _stub(node: ast.FunctionDef, indent: str) -> str | None:
    """A public function's signature and docstring, indented; None without a 2+ line docstring."""
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or doc.count("\n") < 1 or len(doc) > 1200:
        return None
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    body = "\n".join(indent + "    " + line if line else "" for line in doc.splitlines())
    return f'{indent}def {node.name}({args}){ret}:\n{indent}    """{body.strip()}\n{indent}    """\n'


def training_prompts(seed: int, n_code: int | None = None, n_chat: int | None = None,
                     requests: list[str] = ()) -> list[tuple[str, str]]:
    """[(kind, prompt)] shuffled with `seed`, code and chat alternating (a harvest cut short by
    its budget has as many of each) until one kind runs out. `requests` (the target's own user
    turns, `user_requests`) come first among the chat prompts, two for each templated one."""
    rng = random.Random(seed)
    code, chat = code_prompts(), chat_prompts()
    rng.shuffle(code)
    rng.shuffle(chat)
    if requests:
        chat = [p for i in range(0, max(len(requests), 2 * len(chat)), 2)
                for p in list(requests[i: i + 2]) + chat[i // 2: i // 2 + 1]]
    code, chat = code[:n_code] if n_code else code, chat[:n_chat] if n_chat else chat
    items = []
    for i in range(max(len(code), len(chat))):
        items += [("code", p) for p in code[i: i + 1]] + [("chat", p) for p in chat[i: i + 1]]
    return items


def user_turn_prefix(tokenizer) -> list[int] | None:
    """The chat template's ids up to where a user's message begins (a system turn included), or
    None for a model without a chat template."""
    mark = "SPECDEC-USER-MESSAGE"
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}])
    return tokenizer.encode(text[: text.index(mark)], add_special_tokens=False) if mark in text else None


def user_requests(model, tokenizer, n: int, seed: int, batch: int, temperature: float = 0.9,
                  max_new: int = 64, deadline: float | None = None, on_sequence=None,
                  exclude: Iterable[str] = ()) -> list[str]:
    """Chat prompts written by the target itself (as Magpie does): sampled `n` times from the
    start of a user turn, each kept if it ends its turn within `max_new` tokens, is 6+ tokens,
    mostly ASCII and new (none of `exclude`: the held-out prompts). The target's own idea of what
    users ask is more varied than any template list, and costs no download."""
    prefix = user_turn_prefix(tokenizer)
    if prefix is None or n <= 0:
        return []
    seqs = harvest(model, tokenizer, [("user", prefix)] * n, max_new, batch, seed, sampled_share=1.0,
                   temperature=temperature, deadline=deadline, on_sequence=on_sequence)
    eos = set(tokenizer.eos_token_ids)
    seen, out = set(exclude), []
    for s in sorted(seqs, key=lambda s: s.index):
        answer = s.tokens[s.prompt_len:]
        if len(answer) < 7 or answer[-1] not in eos:
            continue
        text = tokenizer.decode(answer[:-1]).strip()
        if text and text not in seen and sum(ord(c) > 127 for c in text) <= 0.02 * len(text):
            seen.add(text)
            out.append(text)
    return out


def corpus_chunks(tokenizer, seed: int, window: int = CORPUS_WINDOW) -> Iterator[tuple[str, list[int]]]:
    """Text for teacher forcing, (kind, token ids) in chunks of at most `window` tokens, from what
    every Python installation holds: the standard library's own modules ("corpus-code") and the
    Python reference's prose (pydoc_data.topics, "corpus-text"). Texts in an order shuffled with
    `seed`; the two kinds alternate until the prose runs out (it is the smaller, and chat is the
    harder domain). Lazy: a budget tokenises only what it reads."""
    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    topics = sorted(PYTHON_REFERENCE)
    rng.shuffle(topics)

    def code_texts() -> Iterator[str]:
        for path in files:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    def chunks(kind: str, texts: Iterable[str]) -> Iterator[tuple[str, list[int]]]:
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            for a in range(0, len(ids), window):
                if len(ids) - a >= 64:
                    yield kind, ids[a: a + window]

    prose = chunks("corpus-text", (PYTHON_REFERENCE[t] for t in topics))
    code = chunks("corpus-code", code_texts())
    for pair in zip(prose, code):
        yield from pair
    yield from prose
    yield from code


@torch.inference_mode()
def teacher_force(model, chunks: Iterable[tuple[str, list[int]]], window: int = CORPUS_WINDOW,
                  deadline: float | None = None, token_budget: int | None = None,
                  on_sequence=None, taps: tuple[int, ...] = ()) -> list[Sequence]:
    """The target reads each chunk (at most `window` tokens) in one prefill (no sampling: the
    text is given) and every position's final hidden state is kept: the fixed-data half of the
    recipe (EAGLE's), about 3x faster per token here than the target writing its own answers.
    Stops starting chunks after `deadline` or once `token_budget` tokens are read;
    on_sequence(seq) as in `harvest` (seq.index: the chunk's place in `chunks`)."""
    cache = model.new_cache(1, window + 1)
    done, read = [], 0
    for index, (kind, ids) in enumerate(chunks):
        if (deadline is not None and time.monotonic() > deadline) or (
                token_budget is not None and read >= token_budget):
            break
        n = len(ids)
        cache.set_length(0, 0)
        _, hidden = model.forward(torch.tensor([ids]), torch.arange(n).view(1, n), cache, return_hidden=True,
                                  logits_at=torch.zeros(1, 0, dtype=torch.long), **_tapped(taps))
        seq = Sequence(list(ids), hidden[0, : n - 1].half(), 0, kind, index)
        done.append(seq)
        read += n
        if on_sequence is not None:
            on_sequence(seq)
    return done


@dataclass
class Sequence:
    """One prompt and the target's answer: tokens [n] and final hidden states [n, dim] (fp16;
    hidden[j] is f_j, the state whose logits predict tokens[j + 1]; harvested with taps,
    [n, (len(taps) + 1) dim]: the tapped layers' residual streams, then f_j); the last token has
    none (it was never fed), so hidden has n - 1 rows."""

    tokens: list[int]
    hidden: torch.Tensor
    prompt_len: int
    kind: str
    index: int = -1  # the prompt's place in harvest's list


@torch.inference_mode()
def harvest(model, tokenizer, prompts: list[tuple[str, str | list[int]]], max_new: int, batch: int, seed: int,
            sampled_share: float = 0.3, temperature: float = 0.7, deadline: float | None = None,
            token_budget: int | None = None, on_sequence=None, taps: tuple[int, ...] = ()) -> list[Sequence]:
    """The target answers each prompt (text, chat-formatted; or token ids, taken as they are),
    greedy or sampled at `temperature` for a `sampled_share` of them (the head also meets the
    target's less likely text), `batch` rows decoding at once; a finished row takes the next
    prompt. Starts no new prompt after `deadline` (time.monotonic()) or once `token_budget`
    tokens (prompts + answers) are written.
    on_sequence(seq): told each finished sequence. taps: also keep the residual streams after
    these layers (Transformer.forward)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    eos = set(tokenizer.eos_token_ids)
    context = min(model.args.max_seq_len, MAX_PROMPT + max_new + 1)
    cache = model.new_cache(batch, context)
    rows: list[dict | None] = [None] * batch
    done: list[Sequence] = []
    written = 0  # tokens (prompts + answers) of the finished sequences
    todo = list(enumerate(prompts))

    def start(row: int) -> None:
        while todo:
            index, (kind, text) = todo.pop(0)
            ids = list(text) if isinstance(text, list) else tokenizer.encode_prompt(text)
            if len(ids) > MAX_PROMPT or len(ids) + max_new >= context:
                continue
            n = len(ids)
            logits, hidden = model.forward(torch.tensor([ids]), torch.arange(n).view(1, n), cache,
                                           rows=torch.tensor([row]), return_hidden=True,
                                           logits_at=torch.tensor([[n - 1]]), **_tapped(taps))
            cache.set_length(row, n)
            rows[row] = dict(kind=kind, index=index, tokens=list(ids), prompt_len=n, hidden=[hidden[0].half()], fed=n,
                             sampled=rng.random() < sampled_share, logits=logits[0, 0])
            return
        rows[row] = None

    def pick(rs: list[dict]) -> list[int]:  # every live row's next token in one batched call
        lg = torch.stack([r["logits"][: tokenizer.vocab_size] for r in rs]).float()
        out = lg.argmax(-1)
        sampled = [i for i, r in enumerate(rs) if r["sampled"]]
        if sampled:  # (torch.multinomial took ~3 ms a row over SmolLM2's 49,152 tokens, inverse_cdf ~0.1)
            u = torch.rand(len(sampled), generator=gen, dtype=torch.float64)
            out[sampled] = inverse_cdf((lg[sampled] / temperature).softmax(-1), u)
        return out.tolist()

    for row in range(batch):
        start(row)
    while any(r is not None for r in rows):
        live = [b for b, r in enumerate(rows) if r is not None]
        for b, t in zip(live, pick([rows[b] for b in live])):  # the next tokens; finish rows that are done
            r = rows[b]
            r["tokens"].append(t)
            if t in eos or len(r["tokens"]) - r["prompt_len"] >= max_new:
                seq = Sequence(r["tokens"], torch.cat(r["hidden"]), r["prompt_len"], r["kind"], r["index"])
                done.append(seq)
                if on_sequence is not None:
                    on_sequence(seq)
                written += len(seq.tokens)
                if (deadline is not None and time.monotonic() > deadline) or (
                        token_budget is not None and written >= token_budget):
                    todo.clear()
                start(b)
        live = [b for b, r in enumerate(rows) if r is not None and r["fed"] < len(r["tokens"])]
        if not live:
            continue
        tok = torch.tensor([[rows[b]["tokens"][-1]] for b in live])
        pos = torch.tensor([[len(rows[b]["tokens"]) - 1] for b in live])
        logits, hidden = model.forward(tok, pos, cache, rows=torch.tensor(live), return_hidden=True, **_tapped(taps))
        for i, b in enumerate(live):
            rows[b]["logits"] = logits[i, 0]
            rows[b]["hidden"].append(hidden[i].half())
            rows[b]["fed"] += 1
            cache.set_length(b, rows[b]["fed"])
    return done


def _tapped(taps: tuple[int, ...]) -> dict:
    return {"taps": tuple(taps)} if taps else {}


# ---- harvested shards ---------------------------------------------------------------------------
def save_shard(path: Path, seqs: list[tuple[int, Sequence]]) -> None:
    toks = torch.tensor([t for _, s in seqs for t in s.tokens], dtype=torch.int32)
    meta = {"items": json.dumps([[i, len(s.tokens), s.prompt_len, s.kind] for i, s in seqs])}
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": toks, "hidden": torch.cat([s.hidden for _, s in seqs]).contiguous()}, str(tmp),
              metadata=meta)
    tmp.replace(path)


def append_shard(work: Path, prefix: str, buf: list[tuple[int, Sequence]],
                 into: list[tuple[int, Sequence]]) -> bool:
    """Write buf as the next shard `prefix-NNNN` (resumable), move it into `into`; False if empty."""
    if not buf:
        return False
    n = len(list(work.glob(f"{prefix}-*.safetensors")))
    save_shard(work / f"{prefix}-{n:04d}.safetensors", buf)
    into.extend(buf)
    buf.clear()
    return True


def load_shards(work: Path, prefix: str = "data") -> list[tuple[int, Sequence]]:
    out = []
    for path in sorted(work.glob(f"{prefix}-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            items = json.loads(f.metadata()["items"])
            toks, hidden = f.get_tensor("tokens").tolist(), f.get_tensor("hidden")
        a = h = 0
        for i, n, plen, kind in items:
            out.append((i, Sequence(toks[a: a + n], hidden[h: h + n - 1], plen, kind)))
            a, h = a + n, h + n - 1
    return out
