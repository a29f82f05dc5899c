"""hpcrl.algo against independent numpy references (plain loops), float64, tolerance 1e-6."""
import numpy as np
import pytest
import torch

from hpcrl import algo

rng = np.random.default_rng(1234)
B, T = 6, 9


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def prefix_mask(lengths):
    return np.array([[1.0 if j < n else 0.0 for j in range(T)] for n in lengths])


def holey_mask():
    m = prefix_mask([9, 7, 3, 1, 5, 8])
    m[0, 2] = m[4, 1] = m[5, 4] = 0.0      # padding inside a row (e.g. a tool's tokens)
    return m


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, atol=1e-6, rtol=1e-6)


def test_kl_estimators():
    lp, ref = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    d = lp - ref
    close(algo.kl_penalty(t(lp), t(ref), "k1"), d)
    close(algo.kl_penalty(t(lp), t(ref), "k2"), 0.5 * d ** 2)
    close(algo.kl_penalty(t(lp), t(ref), "k3"), np.clip(np.exp(-d) - 1 + d, -10, 10))
    with pytest.raises(ValueError, match="k1, k2, k3|'k1', 'k2', 'k3'"):
        algo.kl_penalty(t(lp), t(ref), "k9")


def test_token_level_rewards():
    mask = prefix_mask([9, 4, 1, 6, 2, 7])
    kl, scores, beta = rng.normal(size=(B, T)), rng.normal(size=B), 0.05
    expected = -beta * kl * mask
    for i in range(B):
        expected[i, int(mask[i].sum()) - 1] += scores[i]
    close(algo.token_level_rewards(t(scores), t(kl), t(mask), beta), expected)


def ref_gae(r, v, m, gamma, lam):
    adv = np.zeros_like(v)
    for i in range(r.shape[0]):
        idx = [j for j in range(r.shape[1]) if m[i, j]]
        last = 0.0
        for k in reversed(range(len(idx))):
            j = idx[k]
            nv = v[i, idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[i, j] + gamma * nv - v[i, j]
            last = delta + gamma * lam * last
            adv[i, j] = last
    return adv, (adv + v) * m


@pytest.mark.parametrize("mask", [prefix_mask([9, 7, 3, 1, 5, 8]), holey_mask()], ids=["prefix", "holes"])
def test_gae_over_masked_tokens(mask):
    r, v = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    adv, ret = algo.gae(t(r), t(v), t(mask), 0.97, 0.9)
    ref_adv, ref_ret = ref_gae(r, v, mask, 0.97, 0.9)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_masked_whiten():
    x, mask = rng.normal(size=(B, T)) * 3 + 1, holey_mask()
    vals = x[mask > 0]
    expected = (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8) * mask
    close(algo.masked_whiten(t(x), t(mask)), expected)


def test_grpo_advantages():
    scores, group = rng.normal(size=8), np.array([0, 0, 0, 1, 1, 2, 2, 2])
    mask = np.ones((8, 4))
    mask[2, 3:] = 0
    expected = np.zeros(8)
    for g in np.unique(group):
        s = scores[group == g]
        expected[group == g] = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
    close(algo.grpo_advantages(t(scores), torch.tensor(group), t(mask)), expected[:, None] * mask)
    close(algo.grpo_advantages(t(scores[:1]), torch.tensor([5]), t(np.ones((1, 2)))), np.zeros((1, 2)))


MAX_LEN = 16      # the longest a response may be, for seq-mean-token-sum-norm (not the padded width T)


def seeded(seed):
    """A generator of its own per test: its inputs do not depend on which tests ran before."""
    return np.random.default_rng(seed)


def close_given(a, b, **inputs):
    """close(a, b), the inputs printed when it fails."""
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, atol=1e-6, rtol=1e-6,
                               err_msg="inputs:\n" + "\n".join(f"{k} = {np.array2string(np.asarray(v), precision=4)}"
                                                                for k, v in inputs.items()))


GROUPS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3])      # a group of 1 (3) has nothing to compare with


def test_grpo_advantages_without_the_std_are_dr_grpos():
    scores = seeded(11).normal(size=9)
    mask = prefix_mask([9, 7, 3, 1, 5, 8, 2, 4, 6])
    expected = np.zeros(9)
    for g in np.unique(GROUPS):
        s = scores[GROUPS == g]
        expected[GROUPS == g] = s - s.mean() if len(s) > 1 else 0.0
    close_given(algo.grpo_advantages(t(scores), torch.tensor(GROUPS), t(mask), norm_by_std=False),
                expected[:, None] * mask, scores=scores)


def test_rloo_advantages():
    scores = seeded(12).normal(size=9)
    mask = prefix_mask([9, 7, 3, 1, 5, 8, 2, 4, 6])
    expected = np.zeros(9)
    for i in range(9):
        others = [scores[j] for j in range(9) if GROUPS[j] == GROUPS[i] and j != i]
        expected[i] = scores[i] - sum(others) / len(others) if others else 0.0
    close_given(algo.rloo_advantages(t(scores), torch.tensor(GROUPS), t(mask)), expected[:, None] * mask,
                scores=scores)


def ref_whiten(x, m):
    vals = x[m > 0]
    return (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8) * m


@pytest.mark.parametrize("mask", [prefix_mask([9, 7, 3, 1, 5, 8]), holey_mask()], ids=["prefix", "holes"])
def test_reinforce_pp_advantages_are_whitened_discounted_returns(mask):
    r, gamma = seeded(13).normal(size=(B, T)), 0.9
    returns = np.zeros((B, T))
    for i in range(B):
        valid = [j for j in range(T) if mask[i, j]]
        for k, j in enumerate(valid):
            returns[i, j] = sum(gamma ** n * r[i, jj] for n, jj in enumerate(valid[k:]))
    close_given(algo.discounted_returns(t(r), t(mask), gamma), returns, rewards=r, mask=mask)
    close_given(algo.reinforce_pp_advantages(t(r), t(mask), gamma), ref_whiten(returns, mask), rewards=r, mask=mask)


def test_reinforce_pp_baseline_advantages():
    scores = seeded(14).normal(size=9)
    mask = prefix_mask([9, 7, 3, 1, 5, 8, 2, 4, 6])
    centred = np.array([scores[i] - scores[GROUPS == GROUPS[i]].mean() for i in range(9)])
    close_given(algo.reinforce_pp_baseline_advantages(t(scores), torch.tensor(GROUPS), t(mask)),
                ref_whiten(centred[:, None] * mask, mask), scores=scores)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gspo_clips_one_sequence_ratio_and_gives_each_token_its_gradient(mode):
    gen = seeded(15)
    lp, old = gen.normal(size=(B, T)) * 0.02, gen.normal(size=(B, T)) * 0.02
    adv, m = np.repeat(gen.normal(size=(B, 1)), T, axis=1), holey_mask()
    lo, hi = 3e-3, 4e-3
    s = np.array([np.exp(sum(lp[i, j] - old[i, j] for j in range(T) if m[i, j]) / m[i].sum()) for i in range(B)])
    ratio = np.repeat(s[:, None], T, axis=1)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
    # d loss / d log π_t: −A·s_i where the unclipped term is taken, 0 where the clip holds it
    grad = np.where(l2 > l1, 0.0, -adv * ratio) * m
    if mode == "token-mean":
        expected, grad = (np.maximum(l1, l2) * m).sum() / m.sum(), grad / m.sum()
    else:
        expected = np.mean([(np.maximum(l1, l2)[i] * m[i]).sum() / m[i].sum() for i in range(B)])
        grad = grad / m.sum(axis=1, keepdims=True) / B
    lp_t = t(lp).requires_grad_()
    loss, stats = algo.policy_loss(lp_t, t(old), t(adv), t(m), lo, hi, agg=mode, importance="sequence")
    loss.backward()
    close_given(loss.detach(), expected, log_probs=lp, old_log_probs=old, advantages=adv[:, 0])
    close_given(lp_t.grad, grad, log_probs=lp, old_log_probs=old, advantages=adv[:, 0])
    close_given(stats["clipfrac"], ((l2 > l1) * m).sum() / m.sum(), log_probs=lp, old_log_probs=old)
    assert 0 < stats["clipfrac"] < 1       # the inputs clip some responses and not others


def test_overlong_penalty_is_dapos():
    max_len, buffer, factor = 10, 4, 0.5

    def dapo(n):
        if n <= max_len - buffer:
            return 0.0
        if n <= max_len:
            return (max_len - buffer - n) / buffer
        return -1.0
    lengths = np.arange(0, 13)
    close_given(algo.overlong_penalty(t(lengths), max_len, buffer, factor), [factor * dapo(n) for n in lengths],
                lengths=lengths)
    with pytest.raises(ValueError, match="overlong buffer"):
        algo.overlong_penalty(t(lengths), max_len, 11, factor)


def test_dynamic_sampling_keeps_the_groups_whose_scores_differ():
    scores = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.2])
    expected = [len(set(scores[GROUPS == GROUPS[i]])) > 1 for i in range(9)]
    assert algo.varied_groups(t(scores), torch.tensor(GROUPS)).tolist() == expected == [False] * 3 + [True] * 2 + [False] * 4


def ref_agg(loss, m, mode):
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return np.mean([(loss[i] * m[i]).sum() for i in range(len(m))])
    if mode == "seq-mean-token-sum-norm":
        return np.mean([(loss[i] * m[i]).sum() / MAX_LEN for i in range(len(m))])
    return np.mean([(loss[i] * m[i]).sum() / m[i].sum() for i in range(len(m))])


@pytest.mark.parametrize("mode", algo.losses.AGG_MODES)
def test_aggregation_and_its_invariance_to_micro_batching(mode):
    loss, m = rng.normal(size=(B, T)), prefix_mask([9, 7, 3, 1, 5, 8])
    close(algo.aggregate(t(loss), t(m), mode, max_length=MAX_LEN), ref_agg(loss, m, mode))
    # three micro-batches with the mini-batch's totals add up to the whole
    parts = sum(float(algo.aggregate(t(loss[i:i + 2]), t(m[i:i + 2]), mode, m.sum(), B, MAX_LEN)) for i in range(0, B, 2))
    close(parts, ref_agg(loss, m, mode))


def test_the_length_normalised_aggregation_needs_the_longest_length():
    with pytest.raises(ValueError, match="max_length"):
        algo.aggregate(t(np.ones((2, 3))), t(np.ones((2, 3))), "seq-mean-token-sum-norm")


@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss(dual):
    lp, old = rng.normal(size=(B, T)) * 0.3, rng.normal(size=(B, T)) * 0.3
    adv, m = rng.normal(size=(B, T)) * 2, prefix_mask([9, 7, 3, 1, 5, 8])
    lo, hi = 0.2, 0.28
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
    per = np.maximum(l1, l2)
    if dual:
        per = np.where(adv < 0, np.minimum(per, -adv * dual), per)
    loss, stats = algo.policy_loss(t(lp), t(old), t(adv), t(m), lo, hi, dual)
    close(loss, (per * m).sum() / m.sum())
    close(stats["clipfrac"], ((l2 > l1) * m).sum() / m.sum())
    close(stats["approx_kl"], (-(lp - old) * m).sum() / m.sum())


def test_truncated_importance_sampling_weights_the_policy_loss():
    lp, old, rollout = (rng.normal(size=(B, T)) * 0.3 for _ in range(3))
    adv, m, cap = rng.normal(size=(B, T)) * 2, holey_mask(), 1.5
    w = np.array([[min(np.exp(old[i, j] - rollout[i, j]), cap) for j in range(T)] for i in range(B)])
    close(algo.truncated_is_weights(t(old), t(rollout), cap), w)
    ratio = np.exp(lp - old)
    per = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)) * w
    loss, _ = algo.policy_loss(t(lp), t(old), t(adv), t(m), is_weights=algo.truncated_is_weights(t(old), t(rollout), cap))
    close(loss, (per * m).sum() / m.sum())


def test_masked_importance_sampling_drops_the_tokens_outside_the_band():
    lp, old, rollout = (rng.normal(size=(B, T)) * 0.5 for _ in range(3))
    adv, m, (low, high) = rng.normal(size=(B, T)) * 2, holey_mask(), (0.7, 1.4)
    kept = np.array([[1.0 if low <= np.exp(old[i, j] - rollout[i, j]) <= high else 0.0 for j in range(T)]
                     for i in range(B)])
    assert 0 < (kept * m).sum() < m.sum()          # the draw has tokens on both sides of the band
    close(algo.masked_is_weights(t(old), t(rollout), low, high), kept)
    ratio = np.exp(lp - old)
    per = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)) * kept
    loss, _ = algo.policy_loss(t(lp), t(old), t(adv), t(m), is_weights=algo.masked_is_weights(t(old), t(rollout), low, high))
    close(loss, (per * m).sum() / m.sum())      # dropped tokens still count in the mean's denominator


def test_value_loss_with_clip():
    v, old, ret, m = rng.normal(size=(B, T)), rng.normal(size=(B, T)), rng.normal(size=(B, T)), holey_mask()
    vc = old + np.clip(v - old, -0.2, 0.2)
    per = np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    loss, stats = algo.value_loss(t(v), t(old), t(ret), t(m), clip=0.2)
    close(loss, 0.5 * (per * m).sum() / m.sum())
    close(stats["clipfrac"], (((vc - ret) ** 2 > (v - ret) ** 2) * m).sum() / m.sum())


def test_entropy_from_logits():
    z = rng.normal(size=(B, T, 11))
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    close(algo.entropy_from_logits(t(z)), -(p * np.log(p)).sum(-1))


def test_truncate_at_eos_keeps_the_stop_token_and_masks_after_it():
    eos, pad = 2, 0
    resp = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    out, mask, has = algo.truncate_at_eos(resp, [eos], pad)
    assert out.tolist() == [[5, 6, 2, 0, 0], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]] and has.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="pad id 2 is also a stop token"):
        algo.truncate_at_eos(resp, [eos], eos)


def test_kl_controllers():
    fixed = algo.FixedKLController(0.1)
    fixed.update(5.0, 64)
    assert fixed.value == 0.1
    ada = algo.AdaptiveKLController(0.1, target=0.05, horizon=1000)
    ada.update(0.5, 64)        # far above target: error clipped to +0.2
    close(ada.value, 0.1 * (1 + 0.2 * 64 / 1000))
    ada.update(0.04, 100)      # below: −0.2 ≤ 0.04/0.05 − 1 = −0.2
    close(ada.value, 0.1 * (1 + 0.2 * 64 / 1000) * (1 - 0.2 * 100 / 1000))
