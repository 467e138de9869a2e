"""The nearest tuned key rule: candidates, log2 distance, tie-breaks, and keys with no candidate."""

import torch

from disttune.unseen import key_distance, nearest_key, parse_key


def test_numeric_parts_by_log2_distance():
    tuned = [(16, "torch.float16"), (64, "torch.float16"), (1024, "torch.float16")]
    assert nearest_key((20, "torch.float16"), tuned) == (16, "torch.float16")
    assert nearest_key((50, "torch.float16"), tuned) == (64, "torch.float16")
    assert nearest_key((300, "torch.float16"), tuned) == (1024, "torch.float16")  # 1.77 against 2.23 from 64
    assert key_distance((32, "a"), (8, "a")) == 2.0


def test_ties_go_to_the_smaller_key_then_its_text():
    tuned = [(32,), (8,)]
    assert nearest_key((16,), tuned) == (8,)                  # both 1 power of two away: the smaller
    assert nearest_key((16,), [(32,), (8,), (16.0,)]) == (16.0,)
    assert nearest_key((12,), [(18,), (8,)]) == (8,)          # equal ratios 1.5: a tie, the smaller key
    assert nearest_key((4,), [(4.0,), (4,)]) == (4,)          # equal numbers: the smaller repr ("(4,)")


def test_exact_parts_must_match_and_mixed_keys():
    tuned = [(64, 128, "torch.float16", True), (64, 128, "torch.bfloat16", True), (4096, 128, "torch.float16", False)]
    assert nearest_key((100, 128, "torch.float16", True), tuned) == (64, 128, "torch.float16", True)
    assert nearest_key((4000, 128, "torch.bfloat16", True), tuned) == (64, 128, "torch.bfloat16", True)
    assert nearest_key((1, 128, "torch.float16", False), tuned) == (4096, 128, "torch.float16", False)
    # several numeric parts: the sum of their log2 distances
    assert nearest_key((8, 8), [(32, 16), (8, 64)]) == (8, 64)    # 0 + 3 against 2 + 1: a tie, the smaller
    assert nearest_key((8, 8), [(32, 16), (8, 128)]) == (32, 16)   # 4 against 3


def test_no_candidate():
    tuned = [(64, "torch.float16"), (64, "torch.float16", "extra")]
    assert nearest_key((64, "torch.float32"), tuned) is None          # dtype differs
    assert nearest_key((64,), tuned) is None                          # structure differs
    assert nearest_key((0, "torch.float16"), tuned) is None           # zero is exact: no tuned 0
    assert nearest_key((64, "torch.float16"), []) is None
    assert nearest_key(("x", "torch.float16"), tuned) is None         # a string where a number was


def test_nested_keys_as_function_tuners_build_them():
    tuned = [((torch.Size([128, 64]), torch.Size([64, 32])), torch.float16),
             ((torch.Size([1024, 64]), torch.Size([64, 32])), torch.float16)]
    key = ((torch.Size([700, 64]), torch.Size([64, 32])), torch.float16)
    assert nearest_key(key, tuned) == tuned[1]
    assert nearest_key(((torch.Size([700, 64]),), torch.float16), tuned) is None


def test_keys_read_back_from_tables():
    assert parse_key(repr((64, "torch.float16", True))) == (64, "torch.float16", True)
    assert parse_key("not a key (") == "not a key ("
