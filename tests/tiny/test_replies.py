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
    assert r.stats() == {"remembered": 1, "prompts_spliced": 1, "replies_spliced": 1, "pieces_reused": 0}


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


def test_later_turns_reuse_their_pieces_and_skip_the_ordinary_tokenization(tok):
    """An agent's turn N+1 repeats turn N's pieces: they come from the piece cache, the ordinary tokenization is
    not made again, and the ids are those a fresh splice (nothing cached) gives."""
    halves, _ = _split_token(tok)
    replies = [halves + list(tok.encode(f" step {k} done", add_special_tokens=False)) for k in range(3)]
    kept = ReplyIds(tok, set())
    for g in replies:
        kept.finished(g)
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix the bug"}]
    calls = []
    for k, g in enumerate(replies):
        msgs = msgs + [{"role": "assistant", "content": tok.decode(g)}, {"role": "user", "content": f"result {k}"}]
        ordinary = list(tok.apply_chat_template(msgs, add_generation_prompt=True))

        def lazy():
            calls.append(k)
            return ordinary

        fresh = ReplyIds(tok, set())
        for h in replies:
            fresh.finished(h)
        assert kept.splice(msgs, {}, lazy) == fresh.splice(msgs, {}, ordinary) != ordinary
    assert calls == [0]  # only the first turn checked its first piece against the ordinary ids
    assert kept.stats()["pieces_reused"] >= 3


def test_prep_threads_tokenize_like_the_event_loop(tiny_models):
    """Requests built on the gateway's prep threads, many at once, get the ids a serial build gives."""
    import asyncio

    from mlxb.engine.engine import Engine
    from mlxb.engine.gateway import Gateway, GenerationInput

    model, tok = tiny_models("tiny-llama")[:2]
    gw = Gateway(Engine(model, tok, max_batch=4), tok, model_name="tiny", prep_threads=4)
    inputs = [GenerationInput(messages=[{"role": "system", "content": "agent " * 200},
                                        {"role": "user", "content": f"task {i} " * (20 + i)}], max_tokens=4)
              for i in range(24)]
    serial = [gw.build(i).prompt_ids for i in inputs]

    async def burst():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*[loop.run_in_executor(gw._prep, gw.build, i) for i in inputs])

    assert [r.prompt_ids for r in asyncio.run(burst())] == serial
    gw.close()
