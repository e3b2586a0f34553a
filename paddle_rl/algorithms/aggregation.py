"""Loss aggregation with global normalizers, so micro-batch and rank splits give the same gradient."""
import paddle

LOSS_AGG_MODES = ("token-mean",)


def aggregate_loss(per_token_loss, response_mask, mode: str = "token-mean", num_tokens=None, num_seqs=None,
                   loss_scale_factor=None):
    """Sum of this micro-batch's share of the mini-batch loss.

    num_tokens / num_seqs are the mini-batch totals over all micro-batches and ranks; they default to this
    micro-batch's own, which makes the result the plain mean.
    """
    mask = response_mask.astype(per_token_loss.dtype)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (per_token_loss * mask).sum() / paddle.clip(paddle.to_tensor(denom, dtype="float32"), min=1.0)
    raise ValueError(f"unknown loss_agg_mode {mode!r} (choose from {', '.join(LOSS_AGG_MODES)})")
