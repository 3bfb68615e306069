"""KeyResolver: conversions decided once per key pattern give what deciding every key gives."""

from __future__ import annotations

from rank0load.integrations._convert import ConversionMatch, StackExperts
from rank0load.integrations._resolve import KeyResolver

LAYERS, EXPERTS = 6, 12


class Counting:
    """A conversion that counts the keys it was asked about."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def match(self, key: str) -> ConversionMatch | None:
        self.calls += 1
        return self.inner.match(key)


def _keys() -> list[str]:
    out = []
    for la in range(LAYERS):
        out.append(f"model.layers.{la}.norm.weight")
        for e in range(EXPERTS):  # header order: lexicographic, as safetensors stores them
            for w in ("w1", "w2", "w3"):
                out += [
                    f"model.layers.{la}.experts.{e}.{w}.weight",
                    f"model.layers.{la}.experts.{e}.{w}.weight_scale_inv",
                ]
    return sorted(out)


def _model_keys() -> set[str]:
    keys = {f"model.layers.{la}.norm.weight" for la in range(LAYERS)}
    keys |= {f"model.layers.{la}.experts.{n}" for la in range(LAYERS) for n in ("w13", "w2")}
    return keys


RULES = [
    StackExperts(
        "model.layers.*.experts.w13",
        ("model.layers.*.experts.{e}.w1.weight", "model.layers.*.experts.{e}.w3.weight"),
    ),
    StackExperts("model.layers.*.experts.w2", ("model.layers.*.experts.{e}.w2.weight",)),
]


def _direct(key: str, model: set[str]):
    if key in model:
        return key, None
    for rule in RULES:
        found = rule.match(key)
        if found is not None and found.target in model:
            return found.target, found
    return None, None


def test_pattern_rules_equal_every_key_decided_alone():
    model = _model_keys()
    counted = [Counting(r) for r in RULES]
    resolve = KeyResolver(lambda k: k if k in model else None, counted)
    keys = _keys()
    for key in keys:
        assert resolve(key) == _direct(key, model), key
    converted = len([k for k in keys if k not in model])
    # each pattern's rule is read in the first layer, checked on the second layer's first key of the
    # pattern (6 patterns: w1/w2/w3, weight and scale), trusted afterwards
    assert counted[0].calls <= converted // LAYERS + 6, (counted[0].calls, converted)


class Odd:
    """RULES[1], except that expert 5 goes to another tensor (a rule that depends on a number)."""

    def match(self, key: str) -> ConversionMatch | None:
        found = RULES[1].match(key)
        if found is not None and found.expert == 5:
            return found._replace(target=found.target.replace("w2", "odd"), expert=0)
        return found


def test_a_rule_that_depends_on_a_number_is_decided_key_by_key():
    """Expert 5 goes elsewhere: the prediction from expert 0..4 fails on it and the pattern is then
    computed for every key (the odd rule is met before the pattern is trusted)."""
    model = _model_keys() | {f"model.layers.{la}.experts.odd" for la in range(LAYERS)}

    resolve = KeyResolver(lambda k: k if k in model else None, [Odd()])
    for key in _keys():
        found = Odd().match(key) if key not in model else None
        want = (found.target, found) if found is not None and found.target in model else (None, None)
        want = (key, None) if key in model else want
        assert resolve(key) == want, key


def test_repeated_numbers_and_absent_targets():
    """layers.0.experts.0 cannot say which number is the layer: read from later keys; a predicted
    target the model lacks (more layers in the checkpoint than in the model) is decided alone."""
    model = {f"model.layers.{la}.experts.w2" for la in range(2)}
    resolve = KeyResolver(lambda k: k if k in model else None, RULES)
    for la in range(4):
        for e in range(EXPERTS):
            key = f"model.layers.{la}.experts.{e}.w2.weight"
            got = resolve(key)
            if la < 2:
                assert got[0] == f"model.layers.{la}.experts.w2" and got[1].expert == e
            else:
                assert got == (None, None)


def _bulk(resolver: KeyResolver, keys: list[str]):
    """The bulk path's answers, one (canonical key, conversion) pair per key."""
    return list(zip(*resolver.resolve_columns(keys)))


def _resolve_one_by_one(model: set[str], conversions, keys: list[str]):
    resolve = KeyResolver(lambda k: k if k in model else None, conversions)
    return [resolve(k) for k in keys]


def test_resolve_all_equals_every_key_decided_alone():
    """The bulk path (patterns found in one pass, trusted patterns predicted together) gives each
    key's own answer, and still asks the conversions about a layer's worth of keys only."""
    model = _model_keys()
    keys = _keys()
    counted = [Counting(r) for r in RULES]
    got = _bulk(KeyResolver(lambda k: k if k in model else None, counted), keys)
    assert got == [_direct(k, model) for k in keys]
    converted = len([k for k in keys if k not in model])
    assert counted[0].calls <= converted // LAYERS + 6, (counted[0].calls, converted)
    # a model with fewer layers than the checkpoint: predicted targets it lacks are decided alone
    few = {f"model.layers.{la}.experts.{n}" for la in range(2) for n in ("w13", "w2")}
    assert _bulk(KeyResolver(lambda k: k if k in few else None, RULES), keys) == [
        _direct(k, few) for k in keys
    ]


def test_resolve_all_odd_keys_equal_one_by_one():
    """Keys that start or end with a number, numbers of several widths, a Unicode digit, a newline
    or a NUL in a key (those keys cannot be joined: every key is then decided alone), a rule that
    depends on one expert's number: the bulk answers are the one-by-one answers."""
    model = _model_keys() | {f"model.layers.{la}.experts.odd" for la in range(LAYERS)} | {"0.weight"}

    base = _keys() + ["0.weight", "1.weight", "model.layers.3", "model.layers.10.experts.100.w2.weight"]
    base += ["model.layers.\u0661.experts.2.w2.weight", "x.12.y.3.z"]
    for conversions in (RULES, [Odd()]):
        for extra in ([], ["model.layers.1.experts.3.w2.weight\nmore"], ["a.\0.b"]):
            keys = base + extra
            got = _bulk(KeyResolver(lambda k: k if k in model else None, conversions), keys)
            assert got == _resolve_one_by_one(model, conversions, keys), (conversions, extra)


def test_resolve_all_in_small_batches(monkeypatch):
    """Keys are joined a batch at a time (bounded temporaries): batch edges change nothing."""
    from rank0load.integrations import _resolve

    monkeypatch.setattr(_resolve, "_KEYS_AT_ONCE", 7)
    model = _model_keys()
    keys = _keys()
    got = _bulk(KeyResolver(lambda k: k if k in model else None, RULES), keys)
    assert got == [_direct(k, model) for k in keys]
