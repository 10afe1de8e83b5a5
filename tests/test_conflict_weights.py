"""Hand-computed cases of the conflict rules (docs/method.md, "Conflict tokens")."""

import pytest
import torch

from gtpo_kernels import conflict_weights


def run(rows, advantages, group_size=None, weight=2.0):
    """rows: lists of token ids of possibly different lengths; right-padded with -1 (never a real id)."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), -1, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    lam, n = conflict_weights(ids, mask, torch.tensor(advantages, dtype=torch.float64), group_size or len(rows), weight)
    return lam.tolist(), n.tolist()


def test_shared_prefix():
    # t0, t1 equal in a positive and a negative completion; t2 differs, ending the forward run.
    # The last tokens differ, so the reverse run is empty.
    lam, n = run([[5, 6, 7], [5, 6, 8]], [1.0, -1.0])
    assert lam == [[2, 2, 1], [0, 0, 1]]
    assert n == [2, 2]


def test_shared_suffix_of_different_lengths():
    # Right-aligned: (9, 9) ends both completions; the first tokens differ (no forward run).
    # Row 1 is one token shorter, so its conflict positions are t = 1, 2; position 3 is padding.
    lam, n = run([[1, 2, 9, 9], [3, 9, 9]], [1.0, -1.0])
    assert lam == [[1, 1, 2, 2], [1, 0, 0, 1]]
    assert n == [2, 2]


def test_divergence_in_the_middle():
    # Shared prefix (4, 5) and shared suffix (7, 8); t2 differs and belongs to neither run.
    lam, n = run([[4, 5, 6, 7, 8], [4, 5, 1, 7, 8]], [1.0, -1.0])
    assert lam == [[2, 2, 1, 2, 2], [0, 0, 1, 0, 0]]
    assert n == [2, 2]


def test_middle_match_is_not_a_leading_run():
    # Equal at t1 only: the forward run must start at t0, so nothing is a conflict.
    lam, n = run([[1, 5, 2], [3, 5, 4]], [1.0, -1.0])
    assert lam == [[1, 1, 1], [1, 1, 1]]
    assert n == [0, 0]


def test_token_shared_with_positive_completion_only():
    # Rows 0 and 1 are positive and share token 7 at t0; the negative row has 3 there: no conflict.
    # Reverse s=0: row 1 and the negative row 2 both end with 2 -> conflict for them at t=1;
    # row 0 ends with 1, which no negative completion has at s=0.
    lam, n = run([[7, 1], [7, 2], [3, 2]], [1.0, 0.5, -1.5])
    assert lam == [[1, 1], [1, 2], [1, 0]]
    assert n == [0, 1, 1]


def test_zero_advantage_rows_take_no_part():
    # Row 1 has A = 0: it neither creates conflicts nor gets weights, though its tokens are the same.
    # Rows 0 and 2 are identical with opposite signs: both runs cover every token.
    lam, n = run([[5, 5], [5, 5], [5, 5]], [1.0, 0.0, -1.0])
    assert lam == [[4, 4], [1, 1], [0, 0]]
    assert n == [2, 0, 2]


def test_zero_advantage_row_is_not_a_negative_witness():
    # The only completion sharing row 0's tokens has A = 0, so there is no conflict at all.
    lam, n = run([[5, 6], [5, 6], [1, 2]], [1.0, 0.0, -1.0])
    assert lam == [[1, 1], [1, 1], [1, 1]]
    assert n == [0, 0, 0]


def test_identical_completions_with_opposite_signs():
    # Forward and reverse runs both cover every token: W^2 = 4 and 0 * 0 = 0.
    lam, n = run([[3, 1, 4], [3, 1, 4]], [0.5, -0.5])
    assert lam == [[4, 4, 4], [0, 0, 0]]
    assert n == [3, 3]


def test_custom_weight_squares_where_runs_overlap():
    lam, _ = run([[3, 1, 4], [3, 1, 4]], [0.5, -0.5], weight=3.0)
    assert lam == [[9, 9, 9], [0, 0, 0]]


def test_all_positive_group_has_no_conflicts():
    lam, n = run([[3, 1, 4], [3, 1, 4], [3, 9]], [1.0, 2.0, 0.5])
    assert lam == [[1, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert n == [0, 0, 0]


def test_length_one_completions():
    lam, n = run([[9], [9]], [1.0, -1.0])
    assert lam == [[4], [0]]
    assert n == [1, 1]
    lam, n = run([[9], [8]], [1.0, -1.0])
    assert lam == [[1], [1]]
    assert n == [0, 0]


def test_length_one_against_longer_completion():
    # Row 1 = [9] right-aligns with row 0's last token 9 (reverse run), not with its first (2).
    lam, n = run([[2, 9], [9]], [1.0, -1.0])
    assert lam == [[1, 2], [0, 1]]
    assert n == [1, 1]


def test_groups_do_not_see_each_other():
    # Group 0 is all positive, group 1 all negative; the same tokens across groups are no conflict.
    lam, n = run([[5, 6], [5, 6], [5, 6], [5, 6]], [1.0, 1.0, -1.0, -1.0], group_size=2)
    assert lam == [[1, 1]] * 4
    assert n == [0, 0, 0, 0]


def test_padding_values_are_ignored():
    # Padding ids that equal real tokens must not extend a run: row 1 has length 1.
    ids = torch.tensor([[5, 0, 0], [5, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    lam, n = conflict_weights(ids, mask, torch.tensor([1.0, -1.0]), 2)
    # Forward: t0 conflict; t1 row 1 is padding, so row 0's 0 has no negative witness.
    # Reverse: row 0 ends with 0, row 1 with 5: no run.
    assert lam.tolist() == [[2, 1, 1], [0, 1, 1]]
    assert n.tolist() == [1, 1]


def test_fully_masked_row():
    ids = torch.tensor([[5, 6], [5, 6], [5, 6]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 1]], dtype=torch.bool)
    lam, n = conflict_weights(ids, mask, torch.tensor([1.0, -1.0, -1.0]), 3)
    assert lam.tolist() == [[4, 4], [1, 1], [0, 0]]
    assert n.tolist() == [2, 0, 2]


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force_definition(seed):
    """Against a loop that reads the spec literally, on random groups with many shared tokens."""
    g = torch.Generator().manual_seed(seed)
    n_groups, group, length = 3, 4, 6
    ids = torch.randint(0, 3, (n_groups * group, length), generator=g)
    lengths = torch.randint(0, length + 1, (n_groups * group,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randint(-1, 2, (n_groups * group,), generator=g).double()
    lam, n = conflict_weights(ids, mask, adv, group)

    def raw(i, pos_of):  # pos_of(row, k) -> position index or None
        b = i // group
        rows = range(b * group, (b + 1) * group)

        def has(k, sign):
            ti = pos_of(i, k)
            for j in rows:
                tj = pos_of(j, k)
                if tj is not None and (adv[j] > 0 if sign > 0 else adv[j] < 0) and ids[j, tj] == ids[i, ti]:
                    return True
            return False

        return lambda k: has(k, +1) and has(k, -1)

    for i in range(n_groups * group):
        li = int(lengths[i])
        fwd = lambda r, k: k if k < int(lengths[r]) else None
        rev = lambda r, k: int(lengths[r]) - 1 - k if k < int(lengths[r]) else None
        cf = set()
        cr = set()
        test_f, test_r = raw(i, fwd), raw(i, rev)
        for k in range(li):
            if not test_f(k):
                break
            cf.add(k)
        for k in range(li):
            if not test_r(k):
                break
            cr.add(li - 1 - k)
        expected = []
        for t in range(length):
            w = 1.0
            for run_set in (cf, cr):
                if adv[i] != 0 and t in run_set:
                    w *= 2.0 if adv[i] > 0 else 0.0
            expected.append(w)
        assert lam[i].tolist() == expected, (i, ids[i], lengths[i])
        assert int(n[i]) == (max(len(cf), len(cr)) if adv[i] != 0 else 0)
