"""GTPO in verl (gtpo_kernels.integrations.verl): the registered estimator and policy losses, run through verl's
own functions (its estimator and policy-loss registries, ``ppo_loss``, its mini-batch iterator with shuffling
and its micro-batch split), against `gtpo_loss` on the same logits in float64.

verl's Ray trainer cannot run here (no GPU, no rollout engine); its ``_compute_advantage`` wrapper is tested
against a stand-in with verl's method signature. Skipped without the ``[verl]`` extra.
"""

import sys
import textwrap
import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos")
pytest.importorskip("verl.workers.utils.losses")
pytest.importorskip("verl.workers.engine.utils", exc_type=ImportError)

from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from gtpo_kernels import compute_advantages, conflict_weights, gtpo_loss  # noqa: E402
from gtpo_kernels.integrations import verl as gv  # noqa: E402

DT = torch.float64
PROMPT = 2  # prompt tokens per row in the stand-in batches
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


@pytest.fixture(autouse=True)
def _fresh_gate():
    gv.reset_initial_entropy()
    yield
    gv.reset_initial_entropy()


def _batch(seed, groups=3, group_size=4, length=7, vocab=11):
    """Rows sorted by group. Small id range so that completions share tokens (conflicts); rows of varied
    lengths (one of a single token); one group with equal rewards; logits scaled per row so that some
    completions are below the entropy threshold and some above."""
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    ids = torch.randint(0, 3, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    lengths[1] = 1
    mask = (torch.arange(length)[None] < lengths[:, None]).to(DT)
    scale = torch.where(torch.arange(n) % 3 == 0, 6.0, 1.0).to(DT)
    logits = torch.randn(n, length, vocab, generator=g, dtype=DT) * scale[:, None, None]
    logits[torch.arange(n)[:, None], torch.arange(length)[None], ids] += 2.0 * scale[:, None]
    rewards = torch.randint(0, 2, (n,), generator=g).to(DT)
    rewards[group_size : 2 * group_size] = 1.0  # equal rewards
    old = torch.randn(n, length, generator=g, dtype=DT) * 0.15  # added to logp: ratios off 1, some clipped
    return ids, mask, logits, rewards, old


def _stats(logits, ids):
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _actor(loss_mode, loss_agg_mode, scale=None):
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=scale,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        clip_ratio=0.2,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
    )


def _verl_step_losses(
    logits, ids, mask, rewards, old_shift, algorithm, actor, perm, mini_batch, micro_batch, dp_size=1
):
    """verl's path: advantages from the registered estimator (rows in the order ``perm``, groups by uid), then
    per mini-batch (verl's shuffling iterator) the sum of ``ppo_loss`` over verl's micro-batches.
    Returns ``[(rows of the mini-batch, its loss)]``, differentiable w.r.t. ``logits``."""
    n, length = ids.shape
    logp, entropy = _stats(logits, ids)
    old = (logp.detach() + old_shift) * mask
    uid = np.array([f"prompt-{int(i) // 4}" for i in range(n)], dtype=object)
    token_rewards = torch.zeros(n, length, dtype=DT)
    last = mask.sum(1).long() - 1
    token_rewards[torch.arange(n), last] = rewards
    estimator = core_algos.get_adv_estimator_fn(gv.ESTIMATOR)
    advantages, _ = estimator(
        token_level_rewards=token_rewards[perm],
        response_mask=mask[perm],
        index=uid[perm],
        config=algorithm,
        responses=ids[perm],
        entropy=entropy.detach()[perm],
    )
    attention = torch.cat([torch.ones(n, PROMPT, dtype=torch.long), mask[perm].long()], dim=1)
    batch = TensorDict(
        {
            "prompts": torch.ones(n, PROMPT, dtype=torch.long),
            "responses": ids[perm],
            "attention_mask": attention,
            "response_mask": mask[perm],
            "old_log_probs": old[perm],
            "advantages": advantages,
            "row": perm.clone(),
        },
        batch_size=n,
    )
    steps = []
    for mini in tu.make_iterator(
        batch, mini_batch_size=mini_batch, epochs=1, seed=7, dataloader_kwargs={"shuffle": True}
    ):
        tu.assign_non_tensor(
            mini,
            dp_size=dp_size,
            batch_num_tokens=int(mini["response_mask"].sum()) * dp_size,
            global_batch_size=len(mini) * dp_size,
            micro_batch_size_per_gpu=micro_batch,
            use_dynamic_bsz=False,
        )
        micro_batches, _ = prepare_micro_batches(mini)
        total = 0.0
        for micro in micro_batches:
            pieces = []  # the model's flat per-position log-probs: response token t sits at PROMPT - 1 + t
            for row in micro["row"].tolist():
                resp = int(mask[row].sum())
                pieces += [torch.zeros(PROMPT - 1, dtype=DT), logp[row, :resp], torch.zeros(1, dtype=DT)]
            loss, _ = ppo_loss(actor, {"log_probs": torch.cat(pieces)}, micro)
            total = total + loss
        steps.append((mini["row"], total))
    return steps


def _reference(logits, ids, mask, rewards, old_shift, config, rows, initial_entropy):
    """`gtpo_loss` on one optimiser step's rows (any subset), with advantages and conflict weights from whole
    groups."""
    logp, _ = _stats(logits, ids)
    old = (logp.detach() + old_shift) * mask
    advantages = compute_advantages(rewards, 4, normalize_std=config.normalize_advantages_by_std)
    lam, n_conflict = conflict_weights(ids, mask, advantages, 4, config.conflict_weight)
    return gtpo_loss(
        logits[rows],
        ids[rows],
        mask[rows],
        advantages[rows],
        config=config,
        old_logprobs=old[rows],
        conflict=(lam[rows], n_conflict[rows]),
        initial_entropy=initial_entropy,
        backend="torch",
    ).loss


CASES = [  # (preset, loss_mode, loss_agg_mode, extra algorithm.gtpo knobs)
    ("paper", "gtpo", "seq-mean-token-mean", {"initial_entropy": 0.5}),  # filter on
    ("paper", "gtpo", "seq-mean-token-mean", {}),  # gate: the measured initial entropy switches the filter off
    ("official", "gtpo_sum", "seq-mean-token-mean", {}),
    ("grpo", "gtpo", "seq-mean-token-mean", {}),
    ("paper", "gtpo", "token-mean", {"loss_reduction": "token_mean", "initial_entropy": 0.5}),
    ("official", "gtpo", "seq-mean-token-sum-norm", {"loss_reduction": "dr_grpo", "entropy_threshold": 1.0}),
    # verl's own losses on GTPO's folded per-token advantages: PPO's clip (vanilla) and SAPO are GTPO with that
    # ratio function
    ("paper", "vanilla", "seq-mean-token-mean", {"initial_entropy": 0.5}),
    ("paper", "sapo", "seq-mean-token-mean", {"initial_entropy": 0.5}),  # verl's SAPO takes no other
]


@pytest.mark.parametrize("preset,loss_mode,agg,knobs", CASES)
@pytest.mark.parametrize("mini_batch", [12, 4])
def test_verl_steps_equal_gtpo_loss(preset, loss_mode, agg, knobs, mini_batch):
    ids, mask, logits, rewards, old_shift = _batch(seed=3)
    logits.requires_grad_(True)
    length = ids.shape[1]
    algorithm = OmegaConf.create({"adv_estimator": "gtpo", "gtpo": {"preset": preset, **knobs}})
    actor = _actor(loss_mode, agg, scale=length + 2 if agg == "seq-mean-token-sum-norm" else None)
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(1))  # rows in any order
    steps = _verl_step_losses(logits, ids, mask, rewards, old_shift, algorithm, actor, perm, mini_batch, micro_batch=2)
    config, initial = gv.gtpo_settings(algorithm)
    config = config.replace(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, max_completion_length=length + 2)
    if loss_mode == "sapo":  # verl's SAPO, its temperatures the actor's (tau_pos, tau_neg)
        config = config.replace(
            ratio_function="sapo", sapo_temperature_pos=actor.tau_pos, sapo_temperature_neg=actor.tau_neg
        )
    if initial is None and config.entropy_gate:
        _, entropy = _stats(logits.detach(), ids)
        initial = float((entropy * mask).sum() / mask.sum())
    assert len(steps) == ids.shape[0] // mini_batch
    largest = 0.0
    for rows, verl_loss in steps:
        ours = _reference(logits, ids, mask, rewards, old_shift, config, rows, initial)
        (g_verl,) = torch.autograd.grad(verl_loss, logits, retain_graph=True)
        (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
        verl_value, our_value = float(verl_loss.detach()), float(ours.detach())
        assert abs(verl_value - our_value) <= 1e-10 * max(1.0, abs(our_value)), (verl_value, our_value)
        assert torch.allclose(g_verl, g_ours, rtol=1e-10, atol=1e-12)
        largest = max(largest, float(g_ours.abs().max()))
    assert largest > 1e-3  # a gradient to compare, not zeros


def test_data_parallel_ranks_add_up():
    """Two ranks, each with half of a mini-batch: verl multiplies by dp_size, DDP averages the two."""
    ids, mask, logits, rewards, old_shift = _batch(seed=5)
    logits.requires_grad_(True)
    algorithm = OmegaConf.create({"adv_estimator": "gtpo", "gtpo": {"preset": "paper", "initial_entropy": 0.5}})
    actor = _actor("gtpo", "seq-mean-token-mean")
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    # each rank holds 6 rows; verl's counts are those of the whole mini-batch (12 rows, both ranks' tokens)
    total = 0.0
    config, initial = gv.gtpo_settings(algorithm)
    config = config.replace(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH)
    logp, entropy = _stats(logits, ids)
    old = (logp.detach() + old_shift) * mask
    uid = np.array([f"p{i // 4}" for i in range(12)], dtype=object)
    token_rewards = torch.zeros(12, ids.shape[1], dtype=DT)
    token_rewards[torch.arange(12), mask.sum(1).long() - 1] = rewards
    adv, _ = gv.compute_gtpo_advantage(token_rewards, mask, uid, algorithm, responses=ids, entropy=entropy.detach())
    actor.global_batch_info.update(dp_size=2, global_batch_size=12, batch_num_tokens=int(mask.sum()))
    for rank_rows in (perm[:6], perm[6:]):
        loss, _ = gv.compute_policy_loss_gtpo(
            old[rank_rows], logp[rank_rows], adv[rank_rows], mask[rank_rows], "seq-mean-token-mean", actor
        )
        total = total + loss / 2  # DDP's average over the two ranks
    ours = _reference(logits, ids, mask, rewards, old_shift, config, torch.arange(12), initial)
    assert abs(float(total.detach() - ours.detach())) <= 1e-10 * max(1.0, abs(float(ours.detach())))


def test_advantages_by_hand():
    """Two groups, rows interleaved and of different sizes. Group "a": rewards 1, 0 -> A = +0.5, -0.5; the
    completions [5, 6, 7] and [5, 6, 8] share positions 0 and 1 (a forward conflict run of 2; the last tokens
    differ, so no reverse run). Group "b": three equal rewards -> A = 0."""
    ids = torch.tensor([[5, 6, 7], [1, 2, 3], [5, 6, 8], [1, 2, 3], [4, 4, 4]])
    mask = torch.ones(5, 3, dtype=DT)
    token_rewards = torch.zeros(5, 3, dtype=DT)
    token_rewards[:, -1] = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=DT)
    uid = np.array(["a", "b", "a", "b", "b"], dtype=object)
    entropy = torch.full((5, 3), 0.3, dtype=DT)
    off = {"entropy_threshold": None, "entropy_coef": 0.0}
    adv, returns = gv.compute_gtpo_advantage(
        token_rewards, mask, uid, {"gtpo": {"preset": "paper", **off}}, responses=ids, entropy=entropy
    )
    expected = torch.tensor([[1.0, 1.0, 0.5], [0, 0, 0], [0, 0, -0.5], [0, 0, 0], [0, 0, 0]], dtype=DT)
    assert torch.equal(adv, expected) and torch.equal(returns, expected)
    # official: divide by the conflict count n = 2 (rows of group a); the shift -gamma * Hbar = -0.03 applies to
    # every row (equal-reward rows too), weighted by lambda.
    adv, _ = gv.compute_gtpo_advantage(
        token_rewards, mask, uid, {"gtpo": {"preset": "official"}}, responses=ids, entropy=entropy
    )
    expected = torch.tensor(
        [[2 * 0.47 / 2, 2 * 0.47 / 2, 0.47 / 2], [-0.03] * 3, [0, 0, -0.53 / 2], [-0.03] * 3, [-0.03] * 3], dtype=DT
    )
    assert torch.allclose(adv, expected, rtol=0, atol=1e-15)


def test_masked_positions_and_holes():
    """A tool's output inside a completion (a hole in response_mask) gets no advantage; padding neither."""
    ids = torch.tensor([[5, 9, 7, 0], [5, 9, 8, 0]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 0, 1, 1]], dtype=DT)
    token_rewards = torch.zeros(2, 4, dtype=DT)
    token_rewards[:, -1] = torch.tensor([1.0, 0.0], dtype=DT)
    adv, _ = gv.compute_gtpo_advantage(
        token_rewards,
        mask,
        np.array(["a", "a"], dtype=object),
        {"gtpo": {"preset": "paper", "entropy_threshold": None, "entropy_coef": 0}},
        responses=ids,
        entropy=torch.zeros(2, 4, dtype=DT),
    )
    # positions 0 and 1 (the hole included) are a conflict run; position 1 is masked, so only position 0 shows it
    assert torch.equal(adv, torch.tensor([[1.0, 0, 0.5, 0], [0, 0, -0.5, -0.5]], dtype=DT))


def test_missing_fields_and_bad_settings_are_named():
    token_rewards = torch.zeros(2, 3, dtype=DT)
    mask = torch.ones(2, 3, dtype=DT)
    uid = np.array(["a", "a"], dtype=object)
    with pytest.raises(ValueError, match="completion ids"):
        gv.compute_gtpo_advantage(token_rewards, mask, uid, {"gtpo": {"preset": "paper"}})
    with pytest.raises(ValueError, match="entropies"):
        gv.compute_gtpo_advantage(
            token_rewards, mask, uid, {"gtpo": {"preset": "paper"}}, responses=torch.zeros(2, 3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.clip_ratio_low"):
        gv.gtpo_settings({"gtpo": {"clip_eps_low": 0.1}})
    with pytest.raises(ValueError, match="algorithm.gtpo.entropy_treshold is not a GTPO setting"):
        gv.gtpo_settings({"gtpo": {"entropy_treshold": 0.5}})
    with pytest.raises(ValueError, match="algorithm.gtpo.ratio_cap acts in the policy loss"):
        gv.gtpo_settings({"gtpo": {"ratio_cap": 1.5}})
    with pytest.raises(ValueError, match="penalty"):
        gv.gtpo_settings({"gtpo": {"entropy_mode": "penalty"}})
    with pytest.raises(ValueError, match="loss_agg_mode='token-sum'"):
        gv.compute_policy_loss_gtpo(mask, mask, mask, mask, "token-sum", _actor("gtpo", "token-sum"))
    with pytest.raises(ValueError, match="loss_scale_factor"):
        gv.compute_policy_loss_gtpo(
            mask, mask, mask, mask, "seq-mean-token-sum-norm", _actor("gtpo", "seq-mean-token-sum-norm")
        )
    with pytest.raises(ValueError, match="one uid per row"):
        gv.compute_gtpo_advantage(token_rewards, mask, uid[:1], {"gtpo": {"preset": "grpo"}})


def _verl_default_config(**overrides):
    """verl's own default PPO config (shipped with verl), with Hydra-style dotted overrides."""
    import importlib.resources

    path = importlib.resources.files("verl.trainer.config") / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(str(path))
    OmegaConf.set_struct(config, False)
    for key, value in overrides.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


EXISTING_KEYS = []  # the example's overrides without "+": Hydra refuses them unless verl's config has them


def _example_overrides():
    """The Hydra overrides of examples/verl_gtpo.sh (``key=value`` lines; ``+key`` adds a key)."""
    import pathlib

    import yaml

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "verl_gtpo.sh"
    overrides = {}
    for line in script.read_text().splitlines():
        line = line.strip().rstrip("\\").strip()
        if "=" not in line or line.startswith(("#", "python", "set ", "DATA=", "MODEL=", '"')):
            continue
        key, value = line.split("=", 1)
        if not key.startswith("+"):
            EXISTING_KEYS.append(key)
        overrides[key.lstrip("+")] = yaml.safe_load(value.strip("'")) if "$" not in value else "placeholder"
    return overrides


EXAMPLE_OVERRIDES = _example_overrides()


def test_example_settings_pass_the_check_and_contradictions_are_refused():
    gv.check_verl_config(_verl_default_config(**EXAMPLE_OVERRIDES))
    assert EXAMPLE_OVERRIDES["algorithm.adv_estimator"] == "gtpo" and len(EXAMPLE_OVERRIDES) > 20
    default = _verl_default_config()

    def has(key):  # the key exists (a mandatory "???" value included)
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(default, parent, default=None) if parent else default
        return node is not None and leaf in node.keys()

    missing = [key for key in EXISTING_KEYS if not has(key)]
    assert not missing, f"examples/verl_gtpo.sh sets keys verl's config does not have: {missing}"
    official = dict(
        EXAMPLE_OVERRIDES,
        **{"algorithm.gtpo.preset": "official", "actor_rollout_ref.actor.policy_loss.loss_mode": "gtpo_sum"},
    )
    gv.check_verl_config(_verl_default_config(**official))
    with pytest.raises(ValueError, match="reduces by sequence_mean, but actor.loss_agg_mode='token-mean'"):
        gv.check_verl_config(
            _verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"actor_rollout_ref.actor.loss_agg_mode": "token-mean"}))
        )
    for own in ("vanilla", "gspo", "cispo", "sapo"):  # verl's ratio losses take GTPO's per-token advantages
        gv.check_verl_config(
            _verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"actor_rollout_ref.actor.policy_loss.loss_mode": own}))
        )
    with pytest.raises(ValueError, match="loss_mode='clip_cov' does not take"):
        gv.check_verl_config(
            _verl_default_config(
                **dict(EXAMPLE_OVERRIDES, **{"actor_rollout_ref.actor.policy_loss.loss_mode": "clip_cov"})
            )
        )
    with pytest.raises(ValueError, match="reduces by token_mean, but .* with loss_mode='sapo' gives sequence_mean"):
        token_mean = {
            "algorithm.gtpo.loss_reduction": "token_mean",
            "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        }
        gv.check_verl_config(
            _verl_default_config(
                **dict(EXAMPLE_OVERRIDES, **token_mean, **{"actor_rollout_ref.actor.policy_loss.loss_mode": "sapo"})
            )
        )
    with pytest.raises(ValueError, match="sums per-completion means, which no loss_agg_mode"):
        gv.check_verl_config(
            _verl_default_config(**dict(official, **{"actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla"}))
        )
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        gv.check_verl_config(_verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"algorithm.use_kl_in_reward": True})))
    with pytest.raises(ValueError, match="bypass_mode"):
        gv.check_verl_config(
            _verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"algorithm.rollout_correction.bypass_mode": True}))
        )


def test_registered_in_verl():
    assert core_algos.get_adv_estimator_fn("gtpo") is gv.compute_gtpo_advantage
    assert core_algos.get_policy_loss_fn("gtpo") is gv.compute_policy_loss_gtpo
    assert core_algos.get_policy_loss_fn("gtpo_sum") is gv.compute_policy_loss_gtpo_sum


def test_entry_point_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("gtpo_kernels") == "gtpo_kernels.integrations.verl"


def test_trainer_wrapper_supplies_ids_and_entropy():
    """The wrapper of verl's V1 ``PPOTrainer._compute_advantage``, on a stand-in with its signature: for
    ``gtpo`` it checks the config and hands the batch's responses and entropies to the estimator."""
    seen = {}

    class PPOTrainer:
        def __init__(self, config):
            self.config = config

        def _compute_advantage(self, batch, metrics):  # verl's calls the estimator without ids/entropy
            token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=DT)
            seen["adv"], _ = core_algos.get_adv_estimator_fn(self.config.algorithm.adv_estimator)(
                token_level_rewards=token_rewards,
                response_mask=torch.ones(2, 2, dtype=DT),
                index=np.array(["u", "u"], dtype=object),
                config=self.config.algorithm,
            )
            return batch

    class Fields(dict):
        def to_padded_tensor(self):
            return self

    tq = types.SimpleNamespace(
        kv_batch_get=lambda keys, partition_id, select_fields: Fields(
            responses=torch.tensor([[3, 4], [3, 5]]),
            response_mask=torch.ones(2, 2),
            entropy=torch.full((2, 2), 0.1, dtype=DT),
        )
    )
    module = types.SimpleNamespace(PPOTrainer=PPOTrainer, tq=tq)
    gv.patch_v1_trainer(module)
    gv.patch_v1_trainer(module)  # idempotent
    config = _verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"algorithm.gtpo.initial_entropy": 0.5}))
    batch = types.SimpleNamespace(keys=["k0", "k1"], partition_id="train")
    PPOTrainer(config)._compute_advantage(batch, {})
    # A = +-0.5, shift -0.1 * 0.1; position 0 is a conflict (3 in both), position 1 is not
    a_pos, a_neg = 0.5 - 0.01, -0.5 - 0.01
    assert torch.allclose(seen["adv"], torch.tensor([[2 * a_pos, a_pos], [0.0, a_neg]], dtype=DT), atol=1e-15)
    bad = _verl_default_config(**dict(EXAMPLE_OVERRIDES, **{"actor_rollout_ref.actor.loss_agg_mode": "token-mean"}))
    with pytest.raises(ValueError, match="reduces by sequence_mean"):
        PPOTrainer(bad)._compute_advantage(batch, {})


def test_hook_runs_after_first_import(tmp_path, monkeypatch):
    """`run_after_import`: the hook runs once, right after the module is first imported, and sees it whole."""
    (tmp_path / "gtpo_probe_mod.py").write_text(
        textwrap.dedent("""
        VALUE = 41
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    gv.run_after_import("gtpo_probe_mod", lambda module: calls.append(module.VALUE))
    assert calls == []
    import gtpo_probe_mod  # noqa: F401

    assert calls == [41]
    gv.run_after_import("gtpo_probe_mod", lambda module: calls.append(module.VALUE + 1))  # already imported
    assert calls == [41, 42]
    sys.modules.pop("gtpo_probe_mod", None)


def test_rollout_importance_weights_scale_each_token():
    """verl's rollout-correction weights (>= 0, per token) multiply each token's policy loss, as its vanilla loss
    does: equal to `gtpo_loss` with the weights folded into the conflict weights."""
    ids, mask, logits, rewards, old_shift = _batch(seed=9)
    logits.requires_grad_(True)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4), dtype=DT) * 2
    algorithm = OmegaConf.create({"adv_estimator": "gtpo", "gtpo": {"preset": "paper", "initial_entropy": 0.5}})
    logp, entropy = _stats(logits, ids)
    old = (logp.detach() + old_shift) * mask
    uid = np.array([f"p{i // 4}" for i in range(12)], dtype=object)
    token_rewards = torch.zeros(ids.shape, dtype=DT)
    token_rewards[torch.arange(12), mask.sum(1).long() - 1] = rewards
    adv, _ = gv.compute_gtpo_advantage(token_rewards, mask, uid, algorithm, responses=ids, entropy=entropy.detach())
    loss, _ = gv.compute_policy_loss_gtpo(
        old, logp, adv, mask, "seq-mean-token-mean", _actor("gtpo", "seq-mean-token-mean"), rollout_is_weights=weights
    )
    config, initial = gv.gtpo_settings(algorithm)
    config = config.replace(clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH)
    advantages = compute_advantages(rewards, 4)
    lam, n_conflict = conflict_weights(ids, mask, advantages, 4)
    ours = gtpo_loss(
        logits,
        ids,
        mask,
        advantages,
        config=config,
        old_logprobs=old,
        initial_entropy=initial,
        conflict=(lam * weights, n_conflict),
        backend="torch",
    ).loss
    (g_verl,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (g_ours,) = torch.autograd.grad(ours, logits)
    assert abs(float(loss.detach() - ours.detach())) <= 1e-10 * max(1.0, abs(float(ours.detach())))
    assert torch.allclose(g_verl, g_ours, rtol=1e-10, atol=1e-12)
