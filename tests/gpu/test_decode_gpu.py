"""The GPU's KV-cache decode step against its own full causal forward."""
import pytest

from test_decode import decode_vs_forward

pytestmark = pytest.mark.gpu


def test_decode_matches_full_forward_gpu():
    decode_vs_forward("cuda", 1e-5)
