"""GRPO's arithmetic (training/objectives/grpo_loss.py, training/objectives/grpo.py) against TRL 1.16's GRPOTrainer itself.

TRL's own methods run on a trainer object given only the attributes they read: its
`_generate_and_score_completions` (generation replaced by fixed completions) for the advantages and
the reference log-probs, its `_get_per_token_logps_and_entropies` (TRL's fused LM head) for the
log-probs, and its `_compute_loss` for the loss, the gradient and the KL metric. The per-token loss
is read out of `_compute_loss` one token at a time (a one-token `tool_mask`, dapo's sum over one
item). Both sides see the same tiny Llama, completions and rewards.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hf_fixtures import make_tiny_llama

trl = pytest.importorskip("trl")

from overdrive.training.objectives import grpo, grpo_loss  # noqa: E402

G = 4  # completions per prompt
MAX_LEN = 6
TEMPERATURE = 0.7


class OneProcess:
    """What TRL's methods ask of an Accelerator, for one process."""

    device = torch.device("cpu")
    process_index, num_processes, is_main_process, sync_gradients = 0, 1, True, True

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def autocast(self):
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_tiny_llama(tmp_path_factory.mktemp("grpo") / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    policy = AutoModelForCausalLM.from_pretrained(base).train()  # TRL reads its mode: "train"
    torch.manual_seed(1)
    with torch.no_grad():  # a policy some way from the reference, so the KL is not 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = AutoModelForCausalLM.from_pretrained(base).eval()
    return tokenizer, policy, reference


def _episode(seed: int = 0):
    """Two prompts of different lengths, G completions each of varied lengths, two reward functions
    (one leaves a row unscored)."""
    rng = torch.Generator().manual_seed(seed)
    prompt_ids = [[3 + int(t) for t in torch.randint(0, 30, (n,), generator=rng)] for n in (5, 3)]
    prompts = [p for p in prompt_ids for _ in range(G)]
    completions = [[3 + int(t) for t in torch.randint(0, 30, (int(n),), generator=rng)]
                   for n in torch.randint(1, MAX_LEN + 1, (2 * G,), generator=rng)]
    first = torch.rand(2 * G, generator=rng).tolist()
    second = [None if i == 2 else float(i % 3) for i in range(2 * G)]
    return prompts, completions, first, second


def _trl_trainer(policy, reference, tokenizer, loss_type: str, beta: float, scale: str, rewards, epsilon_high):
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    first, second = rewards

    def correct(prompts, completions, **kwargs):
        return first

    def formatted(prompts, completions, **kwargs):
        return second

    t = GRPOTrainer.__new__(GRPOTrainer)
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    add_fused_lm_head(policy, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    add_fused_lm_head(reference, temperature=TEMPERATURE)
    values = dict(
        model=policy, ref_model=reference if beta else None, accelerator=OneProcess(), processing_class=tokenizer,
        _tokenizer=tokenizer, environment_factories=None, tools=None, environments=None, pad_to_multiple_of=None,
        mask_truncated_completions=False, eos_token_ids=[tokenizer.eos_token_id], num_iterations=1, use_vllm=False,
        vllm_importance_sampling_correction=False, beta=beta, num_generations=G,
        multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
        reward_weights=torch.tensor([1.0, 0.5]), reward_funcs=[correct, formatted],
        reward_processing_classes=[None, None], reward_func_names=["correct", "formatted"],
        state=SimpleNamespace(global_step=0, num_input_tokens_seen=0), _metrics={"train": defaultdict(list),
                                                                                 "eval": defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False, aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, _entropy_bonus_enabled=False, temperature=TEMPERATURE,
        args=SimpleNamespace(report_to=[], per_device_train_batch_size=2 * G, gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1, use_bias_correction_kl=False,
                             delta=None))
    for name, value in values.items():
        setattr(t, name, value)
    return t


def _trl_scored(t, tokenizer, prompts, completions):
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    t._generate = lambda _: (prompts, completions, None, texts, None, {}, None, [])
    inputs = [{"prompt": tokenizer.decode(p)} for p in prompts]
    return t._generate_and_score_completions(inputs)


def _ours(policy, reference, prompts, completions, rewards, loss_type, beta, scale, epsilon_high, old=None):
    table = torch.tensor([[a, float("nan") if b is None else b] for a, b in zip(*rewards)])
    adv = grpo_loss.group_advantages(table, torch.tensor([1.0, 0.5]), G, scale)
    batch = grpo.completion_batch(prompts, completions, adv.advantages, 0, torch.device("cpu"))
    if beta:
        with torch.no_grad():
            batch["ref_per_token_logps"] = grpo.completion_logps(reference, batch, TEMPERATURE)[0]
    logps, entropy = grpo.completion_logps(policy, batch, TEMPERATURE)
    token = grpo_loss.per_token_loss(logps, old, batch.get("ref_per_token_logps"), batch["advantages"], beta, 0.2,
                                     epsilon_high)
    mask = batch["completion_mask"]
    loss = grpo_loss.reduce(token.loss, mask, loss_type, MAX_LEN) / grpo_loss.units(loss_type, mask)
    return adv, batch, logps, entropy, token, loss


CASES = [("grpo", 0.04, "group", 0.2), ("dapo", 0.0, "group", 0.28), ("dr_grpo", 0.04, "none", 0.2),
         ("bnpo", 0.0, "batch", 0.2), ("dapo", 0.1, "batch", 0.28)]


@pytest.mark.parametrize("loss_type,beta,scale,epsilon_high", CASES)
def test_advantages_log_probs_loss_gradient_and_kl_equal_trls(models, loss_type, beta, scale, epsilon_high):
    tokenizer, policy, reference = models
    prompts, completions, *rewards = _episode()
    t = _trl_trainer(policy, reference, tokenizer, loss_type, beta, scale, rewards, epsilon_high)
    scored = _trl_scored(t, tokenizer, prompts, completions)
    ours = copy.deepcopy(policy)
    adv, batch, logps, entropy, token, loss = _ours(ours, reference, prompts, completions, rewards, loss_type, beta,
                                                    scale, epsilon_high)
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(adv.advantages, scored["advantages"], atol=1e-5, rtol=0)
    if beta:
        torch.testing.assert_close(batch["ref_per_token_logps"][mask], scored["ref_per_token_logps"][mask],
                                   atol=1e-5, rtol=0)
    ids = torch.cat([scored["prompt_ids"], scored["completion_ids"]], dim=1)
    attention = torch.cat([scored["prompt_mask"], scored["completion_mask"]], dim=1)
    trl_logps, trl_entropy, _ = t._get_per_token_logps_and_entropies(t.model, ids, attention, MAX_LEN,
                                                                      compute_entropy=True)
    width = batch["completion_ids"].shape[1]
    torch.testing.assert_close(logps[mask], trl_logps[:, :width][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], trl_entropy[:, :width][mask], atol=1e-5, rtol=0)

    trl_loss = t._compute_loss(t.model, scored)
    trl_loss.backward()
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    for (name, a), b in zip(ours.named_parameters(), t.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
    if beta:
        kl = (token.kl * mask).sum() / mask.sum()
        assert kl.item() == pytest.approx(t._metrics["train"]["kl"][-1], abs=1e-5)
    assert (entropy * mask).sum().item() / mask.sum().item() == pytest.approx(t._metrics["train"]["entropy"][-1],
                                                                               abs=1e-5)


@pytest.mark.slow  # a loss per token: dozens of TRL calls
@pytest.mark.parametrize("loss_type,beta,scale,epsilon_high", CASES[:3])
def test_per_token_loss_equals_trls_token_by_token_with_clipping(models, loss_type, beta, scale, epsilon_high):
    """With old log-probs some way from the policy's (a later iteration), so that both clips bite."""
    tokenizer, policy, reference = models
    prompts, completions, *rewards = _episode(seed=3)
    t = _trl_trainer(policy, reference, tokenizer, "dapo", beta, scale, rewards, epsilon_high)
    scored = _trl_scored(t, tokenizer, prompts, completions)
    with torch.no_grad():
        current = grpo.completion_logps(policy, grpo.completion_batch(prompts, completions, torch.zeros(2 * G), 0,
                                                                      torch.device("cpu")), TEMPERATURE)[0]
    old = current + 0.4 * torch.randn(current.shape, generator=torch.Generator().manual_seed(0))
    *_, token, _ = _ours(policy, reference, prompts, completions, rewards, loss_type, beta, scale, epsilon_high, old)
    mask = scored["completion_mask"]
    assert token.low_clipped[mask.bool()].any() and token.high_clipped[mask.bool()].any()
    with torch.no_grad():
        for i, j in mask.nonzero().tolist():
            one = torch.zeros_like(mask)
            one[i, j] = 1
            inputs = {**scored, "old_per_token_logps": old, "tool_mask": one, "num_items_in_batch": torch.tensor(1.0)}
            expected = t._compute_loss(t.model, inputs)
            assert token.loss[i, j].item() == pytest.approx(expected.item(), abs=1e-5), (i, j)


def test_each_loss_type_splits_into_units_that_sum_to_the_whole_batch(models):
    """The loop's rule: sum over micro-batches of (micro mean x micro units) / all units = the whole batch's loss."""
    tokenizer, policy, reference = models
    prompts, completions, *rewards = _episode(seed=5)
    for loss_type in ("grpo", "dapo", "dr_grpo", "bnpo"):
        *_, whole = _ours(policy, reference, prompts, completions, rewards, loss_type, 0.0, "group", 0.2)
        table = torch.tensor([[a, float("nan") if b is None else b] for a, b in zip(*rewards)])
        adv = grpo_loss.group_advantages(table, torch.tensor([1.0, 0.5]), G, "group").advantages
        parts, counts = [], []
        for span in (slice(0, 3), slice(3, 4), slice(4, 8)):
            batch = grpo.completion_batch(prompts[span], completions[span], adv[span], 0, torch.device("cpu"))
            logps, _ = grpo.completion_logps(policy, batch, TEMPERATURE)
            token = grpo_loss.per_token_loss(logps, None, None, batch["advantages"], 0.0, 0.2, 0.2)
            counts.append(grpo_loss.units(loss_type, batch["completion_mask"]))
            parts.append(grpo_loss.reduce(token.loss, batch["completion_mask"], loss_type, MAX_LEN))
        assert (sum(parts) / sum(counts)).item() == pytest.approx(whole.item(), abs=1e-6), loss_type


def test_gdpo_and_rloo_advantages_equal_trls(models):
    """normalize_then_sum (GDPO) against GRPOTrainer's own scoring; the leave-one-out baseline against
    RLOOTrainer's (raw, and with normalize_advantages, which is rl.scale_rewards=batch)."""
    from trl import RLOOTrainer

    tokenizer, policy, reference = models
    prompts, completions, *rewards = _episode(seed=7)
    table = torch.tensor([[a, float("nan") if b is None else b] for a, b in zip(*rewards)])
    weights = torch.tensor([1.0, 0.5])
    t = _trl_trainer(policy, reference, tokenizer, "dapo", 0.0, "group", rewards, 0.2)
    t.multi_objective_aggregation = "normalize_then_sum"
    expected = _trl_scored(t, tokenizer, prompts, completions)["advantages"]
    ours = grpo_loss.group_advantages(table, weights, G, "group", "normalize_then_sum")
    torch.testing.assert_close(ours.advantages, expected, atol=1e-5, rtol=0)
    for normalize, scale in ((False, "none"), (True, "batch")):
        r = _trl_trainer(policy, reference, tokenizer, "dapo", 0.0, "group", rewards, 0.2)
        r.__class__ = RLOOTrainer
        r.normalize_advantages, r.reward_clip_range = normalize, None
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        r._generate = lambda _: (prompts, completions, texts)  # RLOOTrainer's generation: three values
        scored = r._generate_and_score_completions([{"prompt": tokenizer.decode(p)} for p in prompts])
        expected = scored["advantages"]
        ours = grpo_loss.group_advantages(table, weights, G, scale, baseline="leave_one_out")
        torch.testing.assert_close(ours.advantages, expected, atol=1e-5, rtol=0)


def test_vllms_importance_sampling_ratio_and_loss_equal_trls(models):
    """rl.use_vllm's correction through TRL's own code path (its vLLM branch fed the sampler's log-probs by a
    stubbed `_generate`): the ratio of each mode, and the loss it weights, gradient included."""
    tokenizer, policy, reference = models
    prompts, completions, *rewards = _episode(seed=5)
    with torch.no_grad():
        trainer = grpo.completion_logps(policy, grpo.completion_batch(prompts, completions, torch.zeros(2 * G), 0,
                                                                      torch.device("cpu")), TEMPERATURE)[0]
    sampler = trainer + 0.3 * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(1))
    sampled = [sampler[i, :len(c)].tolist() for i, c in enumerate(completions)]
    sampled[1][0] = None  # vLLM gives None where its log-prob is NaN: no correction there
    for mode, low, high in (("token_truncate", None, 1.2), ("token_mask", 0.8, 1.2), ("sequence_truncate", 0.5, 2.0),
                            ("sequence_mask", None, 1.5)):
        t = _trl_trainer(policy, reference, tokenizer, "dapo", 0.04, "group", rewards, 0.28)
        for name, value in (("use_vllm", True), ("vllm_importance_sampling_correction", True),
                            ("vllm_importance_sampling_mode", mode), ("vllm_importance_sampling_clip_min", low),
                            ("vllm_importance_sampling_clip_max", high)):
            setattr(t, name, value)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        t._generate = lambda _: (prompts, completions, None, texts, sampled, {}, None, [])
        scored = t._generate_and_score_completions([{"prompt": tokenizer.decode(p)} for p in prompts])
        mask = scored["completion_mask"]
        width = mask.shape[1]
        padded = torch.zeros_like(scored["old_per_token_logps"])
        for i, row in enumerate(sampled):
            padded[i, :len(row)] = torch.tensor([float("nan") if x is None else x for x in row])
        ratio = grpo_loss.vllm_importance_ratio(scored["old_per_token_logps"], padded, mask, mode, low, high)
        torch.testing.assert_close(ratio, scored["importance_sampling_ratio"], atol=1e-6, rtol=0, msg=mode)
        assert ratio.min() < ratio.max()  # the correction bites: not all ones
        ours = copy.deepcopy(policy)
        adv, batch, logps, *_ = _ours(ours, reference, prompts, completions, rewards, "dapo", 0.04, "group", 0.28)
        token = grpo_loss.per_token_loss(logps, None, batch["ref_per_token_logps"], batch["advantages"], 0.04, 0.2,
                                         0.28, importance_ratio=ratio.expand(-1, width)[:, :batch["completion_ids"]
                                                                                        .shape[1]])
        loss = grpo_loss.reduce(token.loss, batch["completion_mask"], "dapo", MAX_LEN) / batch["completion_mask"].sum()
        trl_loss = t._compute_loss(t.model, scored)
        assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-5), mode
        if mode != "token_truncate":  # the gradient once: the ratio is a constant of the loss in every mode
            continue
        trl_loss.backward()
        loss.backward()
        for (name, a), b in zip(ours.named_parameters(), t.model.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=f"{mode} {name}")
