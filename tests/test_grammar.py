"""Grammar masks (specdec.grammar): what a JSON schema, regex or Lark grammar allows at each
candidate position of a round, checked against a slow reference, on SmolLM2's real tokenizer and
on a 4-token vocabulary whose masks can be written out by hand."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.grammar import GrammarState, compile_grammar, grammar_tokenizer, reference_masks, tiny_tokenizer
from specdec.runtime.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
TEXT = '{"name": "Bo Li", "n": 17}'
NONE = torch.empty(0, dtype=torch.long)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="module")
def lt(tok):
    return grammar_tokenizer(tok, tok.vocab_size)


@pytest.fixture(scope="module")
def schema_grammar():
    return compile_grammar(json_schema=SCHEMA)


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def state(lt, g, committed=(), V=None):
    s = GrammarState(lt, g, V or lt.vocab_size, "cpu")
    for t in committed:
        s.commit(t)
    return s


def test_tokenizer_is_cached_and_keeps_our_eos(tok, lt):
    """Built once per Tokenizer (it costs ~1 s), with the vocabulary and end ids our engine uses."""
    assert grammar_tokenizer(tok, tok.vocab_size) is lt
    assert lt.vocab_size == tok.vocab_size == 49152
    assert sorted(lt.eos_tokens) == sorted(tok.eos_token_ids)


def test_first_mask_allows_an_object_opening(tok, lt, schema_grammar):
    """Before any output the schema allows only tokens spelling the start of an object: every
    allowed token decodes to text starting with "{", "{" (or "{\"") is allowed, and words and EOS
    are not."""
    mask = state(lt, schema_grammar).inputs(NONE).mask  # [1, V]
    assert mask.shape == (1, tok.vocab_size) and mask.dtype == torch.bool
    allowed = mask[0].nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    # ("{" itself, or '{"' where the layout has no whitespace and the first key must follow)
    assert any(tok.decode([t]) in ("{", '{"') for t in allowed)
    for word in ("a", "name", "Hello", " {"):
        assert ids_of(tok, word)[0] not in allowed, word
    assert not any(mask[0, e] for e in tok.eos_token_ids)


def test_inputs_equal_the_reference(tok, lt, schema_grammar):
    """The fast walk (one matcher, consume + rollback, masks cached per prefix, numpy unpacking)
    equals the slow reference (a fresh matcher per position fed token by token, torch bit ops) at
    every split of a valid output into committed tokens and k = 4 drafts, for the full round and
    for last_only; including drafts that run past the end of the grammar into EOS."""
    ids = ids_of(tok, TEXT) + [min(tok.eos_token_ids)]
    for p in range(0, len(ids)):
        drafts = ids[p:p + 4]
        s = state(lt, schema_grammar, ids[:p])
        ref = reference_masks(lt, schema_grammar, tok.vocab_size, ids[:p], drafts)
        assert torch.equal(s.inputs(torch.tensor(drafts)).mask, ref), p
        for i in range(len(drafts) + 1):  # as the draft loop asks: one prefix at a time
            assert torch.equal(s.inputs(torch.tensor(drafts[:i]), last_only=True).mask[0], ref[i]), (p, i)


def test_inputs_leave_the_state_unchanged(tok, lt, schema_grammar):
    """inputs() is pure: asking twice gives the same masks, and committing afterwards gives the
    same masks as a state that was never asked (so the walk rolled back exactly what it consumed)."""
    ids = ids_of(tok, TEXT)
    s = state(lt, schema_grammar, ids[:3])
    first = s.inputs(torch.tensor(ids[3:8])).mask
    assert torch.equal(s.inputs(torch.tensor(ids[3:8])).mask, first)
    s.inputs(torch.tensor(ids[3:6]), last_only=True)
    for t in ids[3:5]:
        s.commit(t)
    fresh = state(lt, schema_grammar, ids[:5])
    assert torch.equal(s.inputs(torch.tensor(ids[5:9])).mask, fresh.inputs(torch.tensor(ids[5:9])).mask)


def test_rejected_draft_ends_the_walk(tok, lt, schema_grammar):
    """The first draft the grammar refuses ends the walk: the rows up to it are masks (the one
    before it gives it False, so verification rejects it), the rows after it are all True (never
    reached); the state is unchanged and still takes the valid continuation. Ids outside the
    vocabulary (a placeholder -1, an id past V) count as refused."""
    ids = ids_of(tok, TEXT)
    bad = ids_of(tok, "Hello")[0]
    s = state(lt, schema_grammar, ids[:2])
    before = s.inputs(torch.tensor(ids[2:4])).mask
    for wrong in (bad, -1, tok.vocab_size + 5):
        drafts = [ids[2], wrong, ids[4], ids[5]]
        mask = s.inputs(torch.tensor(drafts)).mask
        assert torch.equal(mask[:2], before[:2]) and not mask[1, bad]
        assert mask[2:].all()
        if wrong >= 0:
            assert torch.equal(mask, reference_masks(lt, schema_grammar, tok.vocab_size, ids[:2], drafts))
        assert s.inputs(torch.tensor(drafts), last_only=True).mask.all()
    assert torch.equal(s.inputs(torch.tensor(ids[2:4])).mask, before)
    for t in ids[2:]:
        s.commit(t)
    assert s.accepting


def test_eos_only_where_the_grammar_can_end(tok, lt, schema_grammar):
    """Along a valid output, EOS is allowed exactly when the matcher is accepting, which is only
    after the closing brace; once the object is complete the grammar is stopped and EOS is the
    only token allowed; committing EOS keeps it so."""
    ids = ids_of(tok, TEXT)
    eos = sorted(tok.eos_token_ids)
    s = state(lt, schema_grammar)
    for i, t in enumerate(ids):
        mask = s.inputs(NONE).mask[0]
        assert all(mask[e] == s.accepting for e in eos) and s.accepting == (i == len(ids)), i
        assert not s.stopped
        s.commit(t)
    assert s.accepting and s.stopped
    assert s.inputs(NONE).mask[0].nonzero().flatten().tolist() == eos
    s.commit(eos[0])
    assert s.stopped and s.inputs(NONE).mask[0].nonzero().flatten().tolist() == eos


def test_regex_and_lark_grammars(tok, lt):
    """A regex and a Lark grammar constrain as written: "yes" or "no" then only EOS; a Lark
    sentence "x = <digits>;" allows digits after "x = " and ";" only once one is there."""
    g = compile_grammar(regex="(yes|no)")
    s = state(lt, g)
    first = s.inputs(NONE).mask[0]
    assert first[ids_of(tok, "yes")[0]] and first[ids_of(tok, "no")[0]] and not first[ids_of(tok, "maybe")[0]]
    for t in ids_of(tok, "yes"):
        s.commit(t)
    assert s.stopped and s.inputs(NONE).mask[0].nonzero().flatten().tolist() == sorted(tok.eos_token_ids)

    g = compile_grammar(grammar='start: "x = " NUM ";"\nNUM: /[0-9]+/')
    s = state(lt, g, ids_of(tok, "x = "))
    mask = s.inputs(NONE).mask[0]
    assert mask[tok.token_to_id("7")] and not mask[tok.token_to_id(";")] and not mask[tok.token_to_id("a")]
    s.commit(tok.token_to_id("7"))
    mask = s.inputs(NONE).mask[0]
    assert mask[tok.token_to_id(";")] and mask[tok.token_to_id("8")] and not s.accepting


@pytest.mark.parametrize("kw, field, says", [
    ({"json_schema": {"type": "foo"}}, "json_schema", "Invalid type: foo"),
    ({"json_schema": {"type": "integer", "minimum": "x"}}, "json_schema", "minimum"),
    ({"json_schema": "{not json"}, "json_schema", "is not valid JSON"),
    ({"json_schema": [1]}, "json_schema", "not list"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"regex": "(?=a)b"}, "regex", "look-around"),
    ({"grammar": "start: foo"}, "grammar", 'unknown name: "foo"'),
    ({"grammar": ""}, "grammar", "empty"),
    ({"regex": 3}, "regex", "not a string"),
    ({"regex": "a", "grammar": "start: \"a\""}, "grammar", "exactly one"),
    ({}, None, "got none"),
    ({"json_object": "yes"}, "json_object", "not a boolean"),
])
def test_refused_constraints_name_their_field(kw, field, says):
    """What the library refuses (and malformed input) is a SpecdecError on one line that names the
    field and carries the library's reason: the server's 400 and the CLI's exit 2."""
    with pytest.raises(SpecdecError) as e:
        compile_grammar(**kw)
    msg = str(e.value)
    assert e.value.field == field and "\n" not in msg and says in msg, msg
    if field:
        assert msg.startswith(field), msg


def test_json_schema_forms_and_json_object(tok, lt):
    """A schema as a dict or as its JSON text compiles to the same grammar; json_object allows any
    object, so it starts with "{" and is accepting after "{}"."""
    assert compile_grammar(json_schema=SCHEMA) == compile_grammar(json_schema=json.dumps(SCHEMA))
    s = state(lt, compile_grammar(json_object=True))
    assert s.inputs(NONE).mask[0, tok.token_to_id("{")] and not s.inputs(NONE).mask[0, tok.token_to_id("[")]
    for t in ids_of(tok, "{}"):
        s.commit(t)
    assert s.accepting


def test_grammar_the_vocabulary_cannot_spell_is_refused():
    """A Lark grammar naming a special token the vocabulary lacks passes the tokenizer-free check
    but not the check against the tokenizer, nor GrammarState: a SpecdecError, not a dead matcher."""
    lt = tiny_tokenizer([b"a", b"b", b"}", b"<eos>"], eos=3)
    g = compile_grammar(grammar="start: <|nope|>")
    with pytest.raises(SpecdecError, match="^grammar is not a valid Lark grammar"):
        compile_grammar(grammar="start: <|nope|>", lltok=lt)
    with pytest.raises(SpecdecError, match="vocabulary"):
        GrammarState(lt, g, 4, "cpu")


def test_tiny_vocabulary_masks_by_hand():
    """V = 4 tokens a, b, }, EOS (plus 2 padding ids in a model with V = 6) and the regex a*b: the
    masks are written out. Before b: a or b; after b: only EOS; padding ids never; a refused
    draft (}) leaves the rows after it all True."""
    lt = tiny_tokenizer([b"a", b"b", b"}", b"<eos>"], eos=3)
    assert lt.vocab_size == 4 and lt.eos_tokens == [3]
    g = compile_grammar(regex="a*b")
    s = GrammarState(lt, g, 6, "cpu")
    T, F = True, False
    ab, eos, free = [T, T, F, F, F, F], [F, F, F, T, F, F], [T] * 6
    assert s.inputs(torch.tensor([0, 0, 1])).mask.tolist() == [ab, ab, ab, eos]
    assert s.inputs(torch.tensor([1, 3])).mask.tolist() == [ab, eos, eos]
    assert s.inputs(torch.tensor([0, 2, 1])).mask.tolist() == [ab, ab, free, free]
    assert s.inputs(torch.tensor([0, 2]), last_only=True).mask.tolist() == [free]
    assert torch.equal(s.inputs(torch.tensor([0, 0, 1])).mask[:, :4], reference_masks(lt, g, 4, [], [0, 0, 1]))
    assert not s.accepting
    s.commit(0)
    s.commit(1)
    assert s.accepting and s.stopped and s.inputs(NONE).mask.tolist() == [eos]


def test_eos_drafts_leave_the_state_unchanged():
    """Drafts that end the output (EOS, then EOS again) get EOS-only rows after the EOS, and the
    state is unchanged afterwards. llguidance takes an EOS on a stopped matcher without recording
    it, so a walk that consumed EOS drafts and rolled back its count would undo a committed token
    (here the a): this is the case that catches it."""
    lt = tiny_tokenizer([b"a", b"b", b"}", b"<eos>"], eos=3)
    T, F = True, False
    ab, ab_eos, eos = [T, T, F, F], [T, T, F, T], [F, F, F, T]
    for rx, committed, drafts, want in [("a*b", [0], [1, 3, 3], [ab, eos, eos, eos]),
                                        ("a*b?", [0], [3, 3, 0], [ab_eos, eos, eos, [T] * 4]),
                                        ("a*b", [0, 1], [3, 3], [eos, eos, eos])]:
        g = compile_grammar(regex=rx)
        s = state(lt, g, committed)
        before = s.inputs(NONE).mask
        assert s.inputs(torch.tensor(drafts)).mask.tolist() == want, rx
        assert torch.equal(s.inputs(torch.tensor(drafts)).mask, reference_masks(lt, g, 4, committed, drafts))
        s._masks.clear()  # recompute from the matcher, not the cache
        assert torch.equal(s.inputs(NONE).mask, before), rx
        assert s.matcher.rollback(len(committed)) and not s.matcher.is_error()


def test_ids_past_the_tokenizer_are_never_allowed(tok, lt, schema_grammar):
    """A model whose V exceeds the tokenizer's (padding rows): the extra ids are False in every
    reached row, inside a JSON string too (where almost any token is allowed)."""
    V = tok.vocab_size + 64
    ids = ids_of(tok, TEXT)
    mask = state(lt, schema_grammar, ids[:4], V=V).inputs(torch.tensor(ids[4:6])).mask  # [3, V]
    assert mask.shape == (3, V) and not mask[:, tok.vocab_size:].any()
    assert mask[:, : tok.vocab_size].sum(1).min() > 1000  # inside the string "Bo Li"


@pytest.mark.slow
def test_gguf_pad_entries_are_never_allowed():
    """Qwen2.5-Coder's converted tokenizer.json pads its vocabulary with "[PAD<id>]" entries up to
    V = 151936. Read as text they would be allowed inside a JSON string (the negative control, a
    tokenizer built from the raw JSON, allows them); ours removes them."""
    from specdec.runtime.hub import resolve_model

    tok = Tokenizer.load(resolve_model("qwen2.5-coder-0.5b"))
    V = 151936
    g = compile_grammar(json_schema=SCHEMA)
    prefix = ids_of(tok, '{"name": "')
    mask = state(grammar_tokenizer(tok, V), g, prefix, V=V).inputs(NONE).mask[0]
    assert tok.vocab_size == 151665 and mask[: tok.vocab_size].sum() > 100_000
    assert not mask[tok.vocab_size:].any()
    raw = llguidance.LLTokenizer(tok._tok.to_str(), eos_token=sorted(tok.eos_token_ids))
    assert state(raw, g, prefix, V=V).inputs(NONE).mask[0, tok.vocab_size:].any()
