"""Every tag is built and parsed in ``qkmonitor.output.tags``: what a builder writes, the parsers
read back, and nothing else parses as one."""

from __future__ import annotations

import re

import pytest

from qkmonitor.output.tags import (
    alert_tag,
    head_tag,
    image_tag,
    layer_prefixes,
    layer_tag,
    layer_tag_regex,
    parse_alert_tag,
    parse_layer_tag,
    run_tag,
    worst_tag,
)


@pytest.mark.parametrize("prefix", ["qkmonitor", "a.b", "train-qk", "x/y"])
@pytest.mark.parametrize("metric", ["kappa", "attn_erank_norm", "val/entropy"])
@pytest.mark.parametrize("layer, head", [(0, 0), (7, 31), (123, 4)])
def test_the_parsers_read_back_what_the_builders_write(prefix, metric, layer, head):
    assert parse_layer_tag(prefix, layer_tag(prefix, metric, layer)) == (metric, layer, None)
    assert parse_layer_tag(prefix, head_tag(prefix, metric, layer, head)) == (metric, layer, head)
    assert parse_layer_tag(prefix, worst_tag(prefix, metric, "max", layer)) == (
        f"{metric}_max",
        layer,
        None,
    )
    regex = re.compile(layer_tag_regex(prefix, metric))
    assert regex.match(layer_tag(prefix, metric, layer))
    assert not regex.match(head_tag(prefix, metric, layer, head))
    assert not regex.match(worst_tag(prefix, metric, "min", layer))
    assert not regex.match(layer_tag(prefix + "z", metric, layer))
    assert parse_alert_tag(prefix, alert_tag(prefix, "kappa")) == "kappa"
    assert prefix in layer_prefixes([layer_tag(prefix, metric.split("/")[-1], layer)])


def test_other_tags_parse_as_nothing():
    for tag in (
        "qkmonitor/run/output_lse_rms",
        run_tag("qkmonitor", "output_logit_max"),
        "qkmonitor/kappa/layer_00/head_01",  # never released: a head was a child of its layer
        "qkmonitor/kappa/layer_x",
        "other/kappa/layer_00",
        alert_tag("qkmonitor", "kappa"),
    ):
        assert parse_layer_tag("qkmonitor", tag) is None, tag
    assert parse_alert_tag("qkmonitor", "qkmonitor/alerts/a/b") is None
    assert parse_alert_tag("qkmonitor", "qkmonitor/alerts/") is None
    assert parse_alert_tag("qkmonitor", "qk/alerts/kappa") is None


def test_an_image_follows_the_head_tags_grammar():
    assert image_tag("qkmonitor", "attention", 1, 2) == "qkmonitor/attention/layer_01_head_02"
