"""The order of qkmonitor's collectives is the same on every rank by construction (issue 59): ranks
that ``torchrun`` starts hash strings with different seeds (``PYTHONHASHSEED``), so an order that
follows a set of names differs between them, and a collective of one rank meets another's (gloo:
"op.preamble.length <= op.nbytes ... Is there a distributed collective mismatch"). Here the
interception's copy of a layer's weights for its layout check, which gathers each sharded
projection whole (a collective), in processes started with different hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: gathers a named GQA attention's projections for its layout check and prints their order
SCRIPT = """
import json
import torch.nn.functional as F
from torch import nn
import qkmonitor.attention.intercept as intercept

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads = 4, 2
        self.q_proj, self.k_proj = nn.Linear(32, 32), nn.Linear(32, 16)
        self.v_proj, self.o_proj = nn.Linear(32, 16), nn.Linear(32, 32)

    def forward(self, x):
        q = self.q_proj(x).view(1, -1, 4, 8).transpose(1, 2)
        k = self.k_proj(x).view(1, -1, 2, 8).transpose(1, 2)
        v = self.v_proj(x).view(1, -1, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

module = Attention()
layer = intercept.adapt_intercepted("attn", module, 0)
assert layer.layout_candidates, "the layout is read by its names, before a call"
names = {id(p): n.split(".")[0] for n, p in module.named_parameters()}
gathered = []

def whole(weight):  # records the order of the gathers (a collective each, for a DTensor)
    gathered.append(names[id(weight)])
    return weight

intercept.whole = whole
layer.weights_copy()
print(json.dumps(gathered))
"""


def _gathered(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_layout_checks_gathers_come_in_the_modules_order_under_every_hash_seed():
    # 0 and 3: two seeds under which the set {"q_proj", "k_proj"} iterates in different orders
    orders = {seed: _gathered(seed) for seed in ("0", "3")}
    assert orders == {"0": ["q_proj", "k_proj"], "3": ["q_proj", "k_proj"]}, orders
