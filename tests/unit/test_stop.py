from mlxb.engine.stop import StopMatcher


def run(stops, deltas):
    m = StopMatcher(stops)
    out, hit = "", False
    for d in deltas:
        text, hit = m.feed(d)
        out += text
        if hit:
            return out, True
    return out + m.flush(), False


def test_stop_split_across_tokens_no_leak():
    assert run(["END"], ["abc E", "N", "D more"]) == ("abc ", True)


def test_partial_prefix_released_when_not_a_stop():
    m = StopMatcher(["END"])
    assert m.feed("abE") == ("ab", False)
    assert m.feed("x") == ("Ex", False)


def test_earliest_of_several_stops():
    assert run(["yy", "x"], ["axbyy"]) == ("a", True)


def test_no_stops_passthrough():
    assert run([], ["a", "b"]) == ("ab", False)
