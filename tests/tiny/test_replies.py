"""Resent replies take their generated ids back (mlxb.engine.replies): the next turn's prompt starts from the
cached prompt + reply, even where the reply's text tokenizes otherwise."""

import pytest

from mlxb.engine.replies import ReplyIds


def _split_token(tok):
    """Ids [a, b] of two one-character tokens whose text also has its own single token t (so the ordinary
    tokenization of that text is [t], never [a, b]): what a sampling model may emit."""
    vocab = tok._tokenizer.get_vocab()
    for piece, t in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(piece) != 2 or not piece.isalpha():
            continue
        a, b = vocab.get(piece[0]), vocab.get(piece[1])
        if a is not None and b is not None and tok.encode(piece, add_special_tokens=False) == [t]:
            return [a, b], piece
    pytest.skip("no two-letter token with one-letter halves in this vocabulary")


@pytest.fixture(scope="module")
def tok(tiny_models):
    return tiny_models("tiny-llama")[1]


def turn(tok, reply=None, **kw):
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix the bug"}]
    if reply is not None:
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "now run the tests"}]
    return msgs, list(tok.apply_chat_template(msgs, add_generation_prompt=True, **kw))


def test_a_resent_reply_takes_its_generated_ids_back(tok):
    halves, piece = _split_token(tok)
    gen = halves + list(tok.encode(" and more", add_special_tokens=False))
    text = tok.decode(gen)
    assert list(tok.encode(text, add_special_tokens=False)) != gen  # re-tokenizing loses the generated ids
    eos = next(iter(tok.eos_token_ids))
    r = ReplyIds(tok, {eos})
    r.finished(gen + [eos])  # as delivery hands them over: the ending EOS is not part of the text
    _, first = turn(tok)
    msgs, ordinary = turn(tok, text)
    spliced = r.splice(msgs, {}, ordinary)
    assert spliced != ordinary and tok.decode(spliced) == tok.decode(ordinary)
    assert spliced[:len(first) + len(gen)] == first + gen  # turn 1's prompt, then exactly the generated ids
    assert r.stats() == {"remembered": 1, "prompts_spliced": 1, "replies_spliced": 1}


def test_unknown_replies_and_templates_that_change_the_content_keep_the_ordinary_ids(tok):
    halves, _ = _split_token(tok)
    gen = halves + list(tok.encode(" done ", add_special_tokens=False))
    r = ReplyIds(tok, set())
    r.finished(gen)
    msgs, ordinary = turn(tok, tok.decode(gen) + "!")  # another text: not remembered
    assert r.splice(msgs, {}, ordinary) == ordinary
    trimming = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs, ordinary = turn(tok, tok.decode(gen), chat_template=trimming)  # the reply ends in a space: trimmed
    assert r.splice(msgs, {"chat_template": trimming}, ordinary) == ordinary
    assert r.stats()["prompts_spliced"] == 0
