"""Selector grammar, matching rules, formatting, and the format -> parse round trip."""

from __future__ import annotations

import random

import pytest

from planner.selectors import SelectorError, format_layers, parse_selector, suggest, stage_layers

LLAMA = [
    "model.embed_tokens",
    *[f"model.layers.{i}" for i in range(16)],
    *[f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
    "model.norm",
    "lm_head",
]


def sel(text: str) -> list[str]:
    return parse_selector(text).select(LLAMA)


def test_literal_matches_whole_path_or_dot_aligned_suffix() -> None:
    assert sel("lm_head") == ["lm_head"]
    assert sel("norm") == ["model.norm"]
    assert sel("model.norm") == ["model.norm"]
    assert sel("layers.3") == ["model.layers.3"]
    assert sel("orm") == []  # suffixes align to dots
    assert sel("model") == []  # a prefix is not a suffix


def test_range_is_inclusive_and_exact_on_numbers() -> None:
    assert sel("layers.[0-3]") == [f"model.layers.{i}" for i in range(4)]
    assert sel("layers.[2-2]") == ["model.layers.2"]
    assert sel("layers.[1-1,10-11, 15]") == ["model.layers.1", "model.layers.10", "model.layers.11",
                                            "model.layers.15"]
    # 1 must not match the prefix of 12, nor 12 of 1
    assert parse_selector("layers.[1]").select(["layers.1", "layers.12", "layers.11"]) == ["layers.1"]
    assert parse_selector("layers.[0-12]").select(["layers.12", "layers.120", "layers.01"]) == ["layers.12"]


def test_star_is_one_segment_and_double_star_any_number() -> None:
    assert sel("layers.*") == [f"model.layers.{i}" for i in range(16)]
    assert sel("layers.*.self_attn.q_proj") == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert sel("model.**.q_proj") == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert parse_selector("a.**.c").select(["a.c", "a.b.c", "a.b.d.c", "x.a.c", "ac", "a.c.d"]) == [
        "a.c", "a.b.c", "a.b.d.c", "x.a.c"]
    assert sel("**") == LLAMA


def test_globs_within_a_segment_and_alternatives() -> None:
    assert sel("layers.0.*.[q_proj,k_proj,v_proj]") == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert sel("layers.1.self_attn.?_proj") == [f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"]
    assert sel("layers.1.*.[o_*]") == ["model.layers.1.self_attn.o_proj"]
    assert parse_selector("h_[0-1]").select(["h_0", "h_1", "h_2", "x.h_1"]) == ["h_0", "h_1", "x.h_1"]


def test_commas_inside_brackets_do_not_split() -> None:
    s = parse_selector("embed_tokens, layers.[0-1,3], layers.0.self_attn.[q_proj,k_proj]")
    assert [p.text for p in s.patterns] == ["embed_tokens", "layers.[0-1,3]", "layers.0.self_attn.[q_proj,k_proj]"]
    assert s.select(LLAMA) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.3",
                               "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    assert str(s) == "embed_tokens, layers.[0-1,3], layers.0.self_attn.[q_proj,k_proj]"


def test_select_keeps_the_given_order_and_unmatched_names_patterns() -> None:
    s = parse_selector("lm_head, layerz.[0-3], embed_tokens, nothing")
    assert s.select(LLAMA) == ["model.embed_tokens", "lm_head"]
    assert s.unmatched(LLAMA) == ["layerz.[0-3]", "nothing"]
    assert s.matches("model.embed_tokens") and not s.matches("model.norm")


@pytest.mark.parametrize("text, message", [
    ("", '"" has an empty pattern (two commas in a row, or a comma at an end)'),
    ("a,,b", '"a,,b" has an empty pattern (two commas in a row, or a comma at an end)'),
    ("a..b", '"a..b" has an empty segment (two dots in a row, or a dot at an end)'),
    ("layers.[0-3", "\"layers.[0-3\": '[' is never closed"),
    ("layers.0-3]", "\"layers.0-3]\": ']' without '[' (column 11)"),
    ("a.[[1]]", '"a.[[1]]": brackets cannot nest (column 4)'),
    ("layers.[5-2]", '"layers.[5-2]": range [5-2] is empty; write the smaller number first'),
    ("layers.[0-]", '"layers.[0-]": "0-" is not a range; write it as LOW-HIGH, e.g. 0-11'),
    ("layers.[1,]", '"layers.[1,]": empty alternative inside [1,]'),
    ("[a.b,c]", '"[a.b,c]": alternative "a.b" holds a dot; alternatives are single segments (write separate '
                'patterns instead)'),
    ("a.x**", "\"a.x**\": '**' must be a whole segment, as in 'a.**.b'"),
    ("q proj", '"q proj": whitespace inside a pattern'),
])
def test_parse_errors_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(SelectorError) as info:
        parse_selector(text)
    assert str(info.value) == message


def test_format_layers_compresses_runs() -> None:
    names = ["model.embed_tokens", *[f"model.layers.{i}" for i in range(16)], "model.norm", "lm_head"]
    assert format_layers(names) == "model.embed_tokens, model.layers.[0-15], model.norm, lm_head"
    assert format_layers([f"model.layers.{i}" for i in range(16)]) == "model.layers.[0-15]"
    assert format_layers(["layers.0", "layers.1", "layers.3", "layers.10", "layers.11"]) == "layers.[0-1,3,10-11]"
    assert format_layers(["layers.4"]) == "layers.4"
    assert format_layers(["h.0.attn", "h.1.attn", "h.1.mlp"]) == "h.[0-1].attn, h.1.mlp"
    assert format_layers([]) == ""
    with pytest.raises(ValueError, match=r'module path "a\[0\]" holds "\[", which selectors cannot spell'):
        format_layers(["a[0]"])


def _universe(rng: random.Random) -> list[str]:
    blocks = rng.choice([["layers"], ["model", "layers"], ["transformer", "h"], ["encoder", "block"]])
    n = rng.randint(1, 40)
    head = [rng.choice(["embed", "wte", "model.embed_tokens"])]
    tail = [rng.choice(["norm", "ln_f", "model.norm"]), "lm_head"]
    body = [".".join(blocks + [str(i)]) for i in range(n)]
    sub = [f"{b}.{s}" for b in body[:3] for s in ("attn", "mlp")]
    return head + body + sub + tail


def test_format_then_parse_selects_exactly_the_same_layers() -> None:
    rng = random.Random(0)
    for _ in range(300):
        universe = _universe(rng)
        k = rng.randint(0, len(universe))
        chosen = sorted(rng.sample(range(len(universe)), k))
        if rng.random() < 0.5 and chosen:  # contiguous runs, as stages are
            lo = rng.randrange(len(universe))
            chosen = list(range(lo, rng.randint(lo + 1, len(universe))))
        names = [universe[i] for i in chosen]
        text = format_layers(names)
        assert (parse_selector(text).select(universe) if names else []) == names, text


def test_suggest_fixes_misspelled_words_only_when_the_fix_matches() -> None:
    assert suggest("layerz.[0-3]", LLAMA) == "layers.[0-3]"
    assert suggest("layers.*.self_atn.q_prj", LLAMA) == "layers.*.self_attn.q_proj"
    assert suggest("layers.[20-30]", LLAMA) is None  # spelled right; nothing to fix
    assert suggest("zzz", LLAMA) is None


def test_a_literal_pattern_matches_exactly_what_its_regex_matches() -> None:
    """Patterns with no wildcard or group are matched by string comparison (the fast path)."""
    paths = ["layers.1", "model.layers.1", "xlayers.1", "layers.12", "layers.1.attn", "a.b.layers.1", "1", "s.1",
             "model.layers.11", "layers", "model.layerslayers", "h.0.attn.c_attn", "attn", "c_attn.attn"]
    for text in ["layers.1", "1", "attn", "b.layers.1", "layers", "c_attn", "h.0.attn.c_attn", "model.layers.11"]:
        (pattern,) = parse_selector(text).patterns
        assert pattern.literal
        for path in paths:
            assert pattern.matches(path) == (pattern.regex.fullmatch("." + path) is not None), (text, path)
    assert not any(p.literal for p in parse_selector("layers.*, layers.[0-3], *_proj, h?").patterns)


def test_a_stage_keeps_a_layer_it_names_whole_from_a_stage_that_matches_its_suffix() -> None:
    """torchvision's ResNet: the stem's conv1 and bn1 end every block's conv1 and bn1."""
    names = ["conv1", "bn1", "layer1", "layer2.0.conv1", "layer2.0.bn1", "layer2.0.downsample.0", "fc"]
    stages = [parse_selector("conv1, bn1, layer1"), parse_selector("layer2.0.conv1, layer2.0.bn1, layer2.0.downsample.[0], fc")]
    assert stage_layers(stages, names) == [names[:3], names[3:]]
    overlap = [parse_selector("conv1, bn1, layer1, layer2.0.conv1"),
               parse_selector("layer2.0.conv1, layer2.0.bn1, layer2.0.downsample.0, fc")]
    assert stage_layers(overlap, names) == [names[:4], names[3:]]  # both match it whole: the plan's overlap
