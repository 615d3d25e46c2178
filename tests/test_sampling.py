"""sampling_probs: the one filter shared by draft, target and verification."""

import pytest
import torch

from dspark.runtime.sampling import SamplingBatch, SamplingParams, param_tensors, sampling_probs
from dspark_kernels.reference import sampling_probs_ref, top_k_top_p


def _one_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    t, k, pp = param_tensors([p])
    return sampling_probs(logits[None], t, k, pp)[0]


def test_mixed_batch_equals_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(6, 37) * 3
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5),
              SamplingParams(1.3, top_p=0.6), SamplingParams(0.9, top_k=3, top_p=0.8), SamplingParams(2.0)]
    batch = sampling_probs(logits, *param_tensors(params))
    for i, p in enumerate(params):
        torch.testing.assert_close(batch[i], _one_row(logits[i], p))
    torch.testing.assert_close(batch.sum(-1), torch.ones(6))
    # the sync-free batch path and the kernels' reference definition agree with it
    torch.testing.assert_close(SamplingBatch.from_params(params).probs(logits), batch)
    torch.testing.assert_close(sampling_probs_ref(logits, *param_tensors(params)), batch)


def test_draw_greedy_rows_take_the_argmax_and_sampled_rows_the_inverse_cdf():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(), SamplingParams(1.0), SamplingParams(), SamplingParams(0.5, top_k=3)]
    batch = SamplingBatch.from_params(params)
    u = torch.tensor([0.99, 0.5, 0.0, 0.7])
    tokens, probs = batch.draw(logits, u)
    assert tokens[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert probs.shape == (2, 30)  # the sampled rows only
    cdf = probs.cumsum(-1)
    for row, i in enumerate((1, 3)):
        t = int(tokens[i])
        assert cdf[row, t] > u[i] * cdf[row, -1] and (t == 0 or cdf[row, t - 1] <= u[i] * cdf[row, -1])
    assert SamplingBatch.from_params([SamplingParams()] * 2).draw(logits[:2], u[:2])[1] is None


def test_filters_keep_the_right_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.equal(_one_row(logits, SamplingParams(0.0)), torch.tensor([1.0, 0, 0, 0, 0]))
    assert (_one_row(logits, SamplingParams(1.0, top_k=2)) > 0).sum() == 2
    full = torch.softmax(logits, -1)
    # top_p = mass of the first two tokens (plus a hair) keeps exactly three tokens
    p = float(full[:2].sum()) + 1e-4
    assert (_one_row(logits, SamplingParams(1.0, top_p=p)) > 0).sum() == 3
    # top-k off (0) and top-k = V agree; the unfiltered fast path equals the sorted path
    torch.testing.assert_close(_one_row(logits, SamplingParams(1.0, top_k=5)), full)
    torch.testing.assert_close(
        top_k_top_p(logits[None], torch.tensor([0]), torch.tensor([1.0]))[0], full)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_params_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
