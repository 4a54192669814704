"""SGLang /generate wire format: request building and strict response / stream-event parsing (no I/O).

Everything a response must satisfy before its tokens reach a sample is checked here: output ids are ints,
``output_token_logprobs`` has one finite log-prob per output token with the same token id, the finish reason is
one of stop / length / abort, and stream events are consistent with ``completion_tokens`` (which tells
cumulative from incremental streaming). A violation raises :class:`ResponseError`. Routed experts (MoE, asked for
with a :class:`~slime_corr.routed_experts.RoutedExpertsSpec`) are decoded and checked by `slime_corr.routed_experts`.

Under top-p / top-k, a :class:`~slime_corr.rollout.nucleus.NucleusRequest` asks for the engine's top-N
log-probs (`top_logprobs_num`); ``meta_info.output_top_logprobs`` (per output token N ``[logprob, token_id, text]``,
sorted descending, distinct ids, the sampled token's log-prob equal to its ``output_token_logprobs`` one) gives
the engine's nucleus log-mass per token (`rollout.nucleus`; NaN where its boundary lies beyond the N). A
sampled token outside the engine's own kept set is a protocol error: the server did not sample under the top_p /
top_k it was sent (or reports other log-probs than it samples from).

With ``return_sampling_mask`` (SGLang 0.5.23's request field; `build_generate_request`), the server returns the kept
set of every output token, ``meta_info.output_token_sampling_mask`` (its ids), and with ``sampling_logprobs_mode:
"support"`` ``meta_info.output_token_sampling_logprobs`` (each kept id's log-prob under the renormalized
distribution), cumulative or incremental in a stream like the other per-token lists. Checked (`kept_sets`): one
non-empty set of distinct non-negative ids per output token, one finite log-prob ≤ 0 per id summing to mass 1, and
the sampled token in its set with a renormalized log-prob no smaller than its ``output_token_logprobs`` one (M ≤ 1);
a refusal names the field. The engine's mass log M_μ = lp − lp_trunc then follows exactly at every token. SGLang
0.5.23 serves the mask only with a finite top_k ≤ its ``--sampling-mask-max-tokens`` (4096): `sampling_mask_params`
sends that cap as top_k where top-k is off.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_corr.rollout.nucleus import NucleusRequest, engine_nucleus
from slime_corr.routed_experts import RoutedExpertsError, RoutedExpertsSpec, decode_routed_experts

# Keys of SGLang 0.5.23's SamplingParams schema; any other key makes the server answer 400.
SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed "
    "custom_params beam_width watermark choice".split()
)
FINISH_TYPES = ("stop", "length", "abort")
SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang 0.5.23's --sampling-mask-max-tokens default: the largest top_k with a mask
_MASK, _MASK_LOGPROBS = "meta_info.output_token_sampling_mask", "meta_info.output_token_sampling_logprobs"


class ResponseError(ValueError):
    """A response or stream event that violates the protocol (malformed, misaligned, NaN log-probs...)."""


def build_generate_request(
    input_ids: list[int],
    sampling_params: dict[str, Any] | None,
    rid: str,
    stream: bool = False,
    return_logprob: bool = True,
    return_routed_experts: bool = False,
    top_logprobs_num: int = 0,
    return_sampling_mask: bool = False,
) -> dict[str, Any]:
    """The JSON body of one /generate request (one sample: token ids in, ``n`` must stay 1).
    ``return_routed_experts``: ask for the MoE routes (the server needs ``--enable-return-routed-experts``).
    ``top_logprobs_num``: also the N largest log-probs at every output position (0: not asked).
    ``return_sampling_mask``: also every output token's kept set and its support log-probs (module doc; needs a
    finite ``top_k`` in the sampling params: `sampling_mask_params`)."""
    params = dict(sampling_params or {})
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unknown keys {unknown} (SGLang rejects them with 400)")
    if int(params.get("n", 1) or 1) != 1:
        raise ValueError("sampling_params.n must be 1: send one request per sample (rids stay abortable)")
    if not input_ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids):
        raise ValueError("input_ids: must be a non-empty list of non-negative ints")
    body = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": params,
        "return_logprob": return_logprob,
        "stream": stream,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
    if return_sampling_mask:
        top_k = params.get("top_k")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= SAMPLING_MASK_MAX_TOKENS:
            raise ValueError(f"sampling_params.top_k {top_k!r}: SGLang returns a sampling mask only with a finite "
                             f"top_k in [1, {SAMPLING_MASK_MAX_TOKENS}] (sampling_mask_params sets one)")
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "support"
    if top_logprobs_num:
        if not return_logprob or isinstance(top_logprobs_num, bool) or int(top_logprobs_num) < 1:
            raise ValueError(f"top_logprobs_num {top_logprobs_num!r}: a count >= 1, with return_logprob")
        body["top_logprobs_num"] = int(top_logprobs_num)
    return body


@dataclass
class GenerateOutput:
    """Validated content of a finished /generate response (or of a stream once it ended)."""

    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rid: str = ""
    # [prompt_tokens + completion_tokens - 1, layers, top_k] (slime_corr.routed_experts), when asked for and returned
    routed_experts: torch.Tensor | None = None
    # under a NucleusRequest: the engine's top-N log-probs and ids per output token, and its nucleus log-mass
    # log M_μ per output token (NaN where the nucleus does not fit in the N)
    top_log_probs: list[list[float]] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    nucleus_log_mass: list[float] | None = None
    # with return_sampling_mask: each output token's kept ids and the engine's log-prob of each under its
    # renormalized distribution (SGLang's support log-probs); `nucleus_log_mass` then follows from them exactly
    kept_ids: list[list[int]] | None = None
    kept_log_probs: list[list[float]] | None = None

    @property
    def finish_type(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.get("type")


def _check_finish(fr: Any) -> dict[str, Any] | None:
    if fr is None:
        return None
    if not isinstance(fr, dict) or fr.get("type") not in FINISH_TYPES:
        raise ResponseError(f"finish_reason: unexpected value {fr!r}")
    return fr


class NonFiniteLogProbError(ResponseError):
    """The engine's log-prob of a sampled token is NaN, inf or null: its forward overflowed, or it serves another
    model than the trainer's."""


def _parse_chunk(obj: Any, want_logprobs: bool) -> tuple[list[int], list[float], dict[str, Any]]:
    """Check one response object; returns (output_ids, log_probs, meta_info)."""
    if not isinstance(obj, dict):
        raise ResponseError(f"response: expected an object, got {type(obj).__name__}")
    ids, meta = obj.get("output_ids"), obj.get("meta_info")
    if not isinstance(meta, dict):
        raise ResponseError("meta_info: missing or not an object")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ResponseError("output_ids: missing or not a list of non-negative ints")
    if not isinstance(meta.get("completion_tokens"), int):
        raise ResponseError("meta_info.completion_tokens: missing or not an int")
    log_probs: list[float] = []
    if want_logprobs:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise ResponseError("meta_info.output_token_logprobs: missing (was return_logprob honoured?)")
        if len(entries) != len(ids):
            raise ResponseError(
                f"meta_info.output_token_logprobs: {len(entries)} entries for {len(ids)} output tokens"
            )
        for i, (e, tok) in enumerate(zip(entries, ids, strict=True)):
            if not isinstance(e, list | tuple) or len(e) < 2:
                raise ResponseError(f"output_token_logprobs[{i}]: expected [logprob, token_id, text]")
            lp, etok = e[0], e[1]
            if etok != tok:
                raise ResponseError(f"output_token_logprobs[{i}]: token {etok} != output_ids[{i}] {tok}")
            if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp):
                raise NonFiniteLogProbError(f"output_token_logprobs[{i}] (response token {i}, id {tok}): log-prob "
                                            f"{lp!r} is not a finite number")
            if lp > 1e-4:
                raise ResponseError(f"output_token_logprobs[{i}]: log-prob {lp} > 0")
            log_probs.append(float(lp))
    return ids, log_probs, meta


_TOP = "meta_info.output_top_logprobs"
_NUMBER_TYPES, _INT_TYPES = frozenset({int, float}), frozenset({int})  # (bool is neither: refused)


def _top_entries(meta: dict[str, Any], n_ids: int, num: int, start: int = 0
                 ) -> tuple[list[list[float]], list[list[int]]]:
    """(log-probs, token ids) of ``output_top_logprobs[start:]``, each a list of ``num``; checks the shape and the
    types (order and values are checked once for the whole output: `nucleus_log_mass`)."""
    entries = meta.get("output_top_logprobs")
    if not isinstance(entries, list):
        raise ResponseError(f"{_TOP}: missing (was top_logprobs_num honoured?)")
    if len(entries) != n_ids:
        raise ResponseError(f"{_TOP}: {len(entries)} entries for {n_ids} output tokens")
    values, ids = [], []
    for i in range(start, n_ids):
        row = entries[i]
        if not isinstance(row, list) or len(row) != num:
            got = f"{len(row)} entries" if isinstance(row, list) else repr(row)
            raise ResponseError(f"{_TOP}[{i}]: expected top_logprobs_num={num} [logprob, token_id, text] entries, "
                                f"got {got}")
        try:
            row_values, row_ids = [e[0] for e in row], [e[1] for e in row]
        except (TypeError, IndexError, KeyError):
            row_values, row_ids = [None], [None]
        if not (_NUMBER_TYPES.issuperset(map(type, row_values)) and _INT_TYPES.issuperset(map(type, row_ids))):
            raise ResponseError(f"{_TOP}[{i}]: expected [logprob, token_id, text] entries with a number and an int, "
                                f"got {row[:3]!r}...")
        values.append(row_values)
        ids.append(row_ids)
    return values, ids


def sampling_mask_params(sampling_params: dict[str, Any], cap: int = SAMPLING_MASK_MAX_TOKENS) -> dict[str, Any]:
    """`sampling_params` for a request with ``return_sampling_mask``: top_k = `cap` where top-k is off (SGLang
    0.5.23 refuses the mask otherwise; a top_k at or above the vocabulary truncates nothing) or above `cap`."""
    top_k = sampling_params.get("top_k")
    if top_k is None or int(top_k) <= 0 or int(top_k) > cap:
        return {**sampling_params, "top_k": cap}
    return dict(sampling_params)


def _kept_entries(meta: dict[str, Any], n_ids: int, start: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """(kept ids, support log-probs) of output tokens ``start:`` from ``meta`` (a stream event's, or a whole
    response's), type-checked; the sets' contents are checked once for the whole output (`kept_set_log_mass`)."""
    ids, values = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
    if not isinstance(ids, list) or not isinstance(values, list):
        missing = _MASK if not isinstance(ids, list) else _MASK_LOGPROBS
        raise ResponseError(f"{missing}: missing (was return_sampling_mask / sampling_logprobs_mode \"support\" "
                            "honoured? SGLang >= 0.5.23 serves them)")
    for name, rows in ((_MASK, ids), (_MASK_LOGPROBS, values)):
        if len(rows) != n_ids:
            raise ResponseError(f"{name}: {len(rows)} entries for {n_ids} output tokens")
    out_ids, out_values = [], []
    for i in range(start, n_ids):
        row, lps = ids[i], values[i]
        if not (isinstance(row, list) and _INT_TYPES.issuperset(map(type, row))):
            raise ResponseError(f"{_MASK}[{i}]: expected a list of token ids, got {str(row)[:60]}")
        if not (isinstance(lps, list) and _NUMBER_TYPES.issuperset(map(type, lps))):
            raise ResponseError(f"{_MASK_LOGPROBS}[{i}]: expected a list of log-probs, got {str(lps)[:60]}")
        if len(lps) != len(row):
            raise ResponseError(f"{_MASK_LOGPROBS}[{i}]: {len(lps)} log-probs for the {len(row)} kept ids of "
                                f"{_MASK}[{i}] (was sampling_logprobs_mode \"support\" honoured?)")
        out_ids.append(row)
        out_values.append(lps)
    return out_ids, out_values


def kept_set_log_mass(out: GenerateOutput) -> list[float]:
    """log M_μ = lp − lp_trunc of every output token of `out` from its kept sets (module doc), after checking them;
    raises ResponseError naming the field and the token."""
    assert out.kept_ids is not None and out.kept_log_probs is not None
    mass = []
    for i, (tok, ids, lps) in enumerate(zip(out.output_ids, out.kept_ids, out.kept_log_probs, strict=True)):
        if not ids:
            raise ResponseError(f"{_MASK}[{i}]: an empty kept set (the engine sampled token {tok} from it)")
        if min(ids) < 0 or len(set(ids)) != len(ids):
            raise ResponseError(f"{_MASK}[{i}]: kept ids must be distinct and >= 0")
        if tok not in ids:
            raise ResponseError(f"{_MASK}[{i}]: the sampled token {tok} is not in its kept set of {len(ids)} ids: the "
                                "server did not sample from the set it reports")
        if not all(math.isfinite(v) and v <= 1e-4 for v in lps):
            raise ResponseError(f"{_MASK_LOGPROBS}[{i}]: a log-prob is not a finite number <= 0")
        total = math.fsum(math.exp(v) for v in lps)
        if abs(total - 1.0) > 1e-3:
            raise ResponseError(f"{_MASK_LOGPROBS}[{i}]: the kept set's probabilities sum to {total:.6g}, not 1: "
                                "these are not log-probs renormalized over it (sampling_logprobs_mode \"support\")")
        trunc = lps[ids.index(tok)]
        if not out.log_probs:  # (return_logprob off: the mass is unknown)
            mass.append(math.nan)
            continue
        lp = out.log_probs[i]
        if trunc < lp - 1e-4 * (1 + abs(lp)):
            raise ResponseError(f"{_MASK_LOGPROBS}[{i}]: the sampled token's renormalized log-prob {trunc:.6g} is "
                                f"below its output_token_logprobs one {lp:.6g} (a kept set's mass exceeds 1)")
        mass.append(min(lp - trunc, 0.0))
    return mass


def _first(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def nucleus_log_mass(out: GenerateOutput, request: NucleusRequest) -> list[float]:
    """log M_μ per output token of `out` (NaN where the engine's nucleus does not fit in its top-N), from its
    `top_log_probs` / `top_ids`; raises ResponseError naming the position when the lists are not the engine's
    sorted top-N (non-finite or positive log-probs, out of order, repeated ids, the sampled token's log-prob
    differing from its entry) or the sampled token lies outside the engine's kept set."""
    if not out.output_ids:
        return []
    values = torch.tensor(out.top_log_probs, dtype=torch.float64)
    ids = torch.tensor(out.top_ids, dtype=torch.int64)
    sampled = torch.tensor(out.output_ids, dtype=torch.int64)
    sampled_lp = torch.tensor(out.log_probs, dtype=torch.float64)
    checks = (
        (~values.isfinite() | (values > 1e-4)).any(-1), "a log-prob is not a finite number <= 0",
        (values[:, 1:] > values[:, :-1]).any(-1), "log-probs not sorted in descending order",
        (ids < 0).any(-1), "a token id is negative",
        (ids.sort(-1).values.diff(dim=-1) == 0).any(-1), "a token id appears twice",
    )
    for bad, why in zip(checks[::2], checks[1::2], strict=True):
        if bad.any():
            raise ResponseError(f"{_TOP}[{_first(bad)}]: {why}")
    differs = (values - sampled_lp[:, None]).abs() > 1e-5 * (1 + sampled_lp.abs()[:, None])
    off = ((ids == sampled[:, None]) & differs).any(-1)
    if off.any():
        i = _first(off)
        raise ResponseError(f"{_TOP}[{i}]: the sampled token {out.output_ids[i]} has log-prob "
                            f"{out.log_probs[i]} in output_token_logprobs but another one here")
    nucleus = engine_nucleus(values, ids, sampled, sampled_lp, top_p=request.top_p, top_k=request.top_k)
    outside = nucleus.fits & ~nucleus.inside
    if outside.any():
        i = _first(outside)
        raise ResponseError(f"{_TOP}[{i}]: the sampled token {out.output_ids[i]} (log-prob {out.log_probs[i]:.6g}) "
                            f"lies outside the engine's own top_p={request.top_p} / top_k={request.top_k} set (its "
                            f"first {int(nucleus.kept[i])} tokens): the server does not sample under the truncation "
                            "it was sent")
    return nucleus.log_mass.tolist()


def _spans(meta: dict[str, Any]) -> list[tuple[str, int, int]]:
    spans = meta.get("weight_versions") or []
    try:
        return [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    except (TypeError, KeyError, ValueError) as e:
        raise ResponseError(f"meta_info.weight_versions: malformed ({e})") from e


def _routes(meta: dict[str, Any], completion_tokens: int, spec: RoutedExpertsSpec | None,
            finish: dict[str, Any] | None) -> torch.Tensor | None:
    """The decoded `meta_info.routed_experts` of a finishing event (None when not asked for). Required unless the
    request was aborted (then kept when it fits, else dropped: the resumed request returns them again)."""
    if spec is None or finish is None:
        return None
    data = meta.get("routed_experts")
    aborted = finish.get("type") == "abort"
    if data is None:
        if aborted:
            return None
        raise ResponseError("meta_info.routed_experts: missing (was the server started with "
                            "--enable-return-routed-experts?)")
    try:
        return decode_routed_experts(data, int(meta.get("prompt_tokens", 0) or 0) + completion_tokens - 1, spec)
    except RoutedExpertsError as e:
        if aborted:
            return None
        raise ResponseError(str(e)) from e


def _read_kept_sets(out: GenerateOutput, meta: dict[str, Any]) -> None:
    """`out`'s kept sets from a whole response's `meta` (an abort with no token may come without them)."""
    if not out.output_ids and out.finish_type == "abort" and "output_token_sampling_mask" not in meta:
        out.kept_ids, out.kept_log_probs = [], []
    else:
        out.kept_ids, out.kept_log_probs = _kept_entries(meta, len(out.output_ids))
    out.nucleus_log_mass = kept_set_log_mass(out)


def parse_generate_response(obj: Any, want_logprobs: bool = True, routed_experts: RoutedExpertsSpec | None = None,
                            nucleus: NucleusRequest | None = None, sampling_mask: bool = False) -> GenerateOutput:
    """Validate a non-streaming /generate response body (one sample); with `routed_experts`, decode its routes;
    with `nucleus`, read the engine's nucleus from its top-N log-probs; with `sampling_mask`, its kept sets."""
    ids, lps, meta = _parse_chunk(obj, want_logprobs)
    if meta["completion_tokens"] != len(ids):
        raise ResponseError(f"meta_info.completion_tokens {meta['completion_tokens']} != {len(ids)} output ids")
    fr = _check_finish(meta.get("finish_reason"))
    if fr is None:
        raise ResponseError("meta_info.finish_reason: missing in a finished response")
    out = GenerateOutput(ids, lps, fr, meta.get("weight_version"), _spans(meta), int(meta.get("prompt_tokens", 0)),
                         len(ids), str(meta.get("id", "")), _routes(meta, len(ids), routed_experts, fr))
    if nucleus is not None:
        out.top_log_probs, out.top_ids = _top_entries(meta, len(ids), nucleus.num)
        out.nucleus_log_mass = nucleus_log_mass(out, nucleus)
    if sampling_mask:
        _read_kept_sets(out, meta)
    return out


class StreamAccumulator:
    """Folds SSE events into one :class:`GenerateOutput`, for cumulative and incremental servers alike.

    ``completion_tokens`` is cumulative in both modes: an event whose token count equals it (and extends what
    we have) is cumulative; one whose count plus what we have equals it is a delta. Anything else is an error.
    """

    def __init__(self, want_logprobs: bool = True, routed_experts: RoutedExpertsSpec | None = None,
                 nucleus: NucleusRequest | None = None, sampling_mask: bool = False) -> None:
        self.want_logprobs = want_logprobs
        self.routed_experts = routed_experts  # routes come with the finishing event
        self.nucleus = nucleus  # top-N log-probs come with every event (a cumulative one's new entries are read)
        self.sampling_mask = sampling_mask  # so do the kept sets
        self.out = GenerateOutput(kept_ids=[] if sampling_mask else None, kept_log_probs=[] if sampling_mask else None)
        self.mode: str | None = None  # "cumulative" | "incremental" once told apart
        self.events = 0
        self.done = False

    def feed_line(self, data: str) -> None:
        """Feed the payload of one ``data:`` line (without the prefix)."""
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as e:
            raise ResponseError(f"stream event: malformed JSON ({e})") from e
        if isinstance(obj, dict) and "error" in obj:
            raise StreamErrorEvent(obj["error"])
        self.feed(obj)

    def feed(self, obj: Any) -> None:
        """Feed one decoded event object."""
        if self.out.finish_reason is not None:
            raise ResponseError("stream: event after the finishing event")
        ids, lps, meta = _parse_chunk(obj, self.want_logprobs)
        total, have, n = meta["completion_tokens"], len(self.out.output_ids), len(ids)
        if have == 0 and n != total:
            raise ResponseError(f"stream: first event has {n} tokens but completion_tokens {total}")
        if have > 0 and self.mode is None:  # the first event after tokens arrived tells the modes apart
            if n == total and n >= have:
                self.mode = "cumulative"
            elif have + n == total:
                self.mode = "incremental"
            else:
                raise ResponseError(f"stream: event with {n} tokens after {have} inconsistent with "
                                    f"completion_tokens {total}")
        if self.mode == "incremental":
            if have + n != total:
                raise ResponseError(f"stream: delta of {n} tokens after {have} != completion_tokens {total}")
            self.out.output_ids.extend(ids)  # the lists are ours (decoded from this stream): append in place
            self.out.log_probs.extend(lps)
            self._add_top(meta, n, 0)
        else:
            if n != total or n < have or ids[:have] != self.out.output_ids:
                raise ResponseError(f"stream: cumulative event of {n} tokens inconsistent with {have} received "
                                    f"and completion_tokens {total}")
            if self.want_logprobs and lps[:have] != self.out.log_probs:
                raise ResponseError("stream: cumulative event rewrote earlier log-probs")
            self._add_top(meta, n, have)
            self.out.output_ids, self.out.log_probs = ids, lps
        self.events += 1
        self.out.finish_reason = _check_finish(meta.get("finish_reason"))
        self.out.weight_version = meta.get("weight_version", self.out.weight_version)
        self.out.weight_versions = _spans(meta) or self.out.weight_versions
        self.out.prompt_tokens = int(meta.get("prompt_tokens", 0) or 0)
        self.out.completion_tokens = total
        self.out.rid = str(meta.get("id", self.out.rid))
        self.out.routed_experts = _routes(meta, total, self.routed_experts, self.out.finish_reason)

    def _add_top(self, meta: dict[str, Any], n: int, start: int) -> None:
        if self.nucleus is not None:
            values, ids = _top_entries(meta, n, self.nucleus.num, start)
            self.out.top_log_probs.extend(values)
            self.out.top_ids.extend(ids)
        if self.sampling_mask and (n > start or "output_token_sampling_mask" in meta):
            kept, values = _kept_entries(meta, n, start)
            assert self.out.kept_ids is not None and self.out.kept_log_probs is not None
            self.out.kept_ids.extend(kept)
            self.out.kept_log_probs.extend(values)

    def result(self) -> GenerateOutput:
        """The finished output (with the engine's nucleus log-mass when asked); raises if the stream did not end
        properly."""
        if self.out.finish_reason is None:
            raise ResponseError("stream: ended without a finish_reason")
        if not self.done:
            raise ResponseError("stream: ended without [DONE]")
        if self.nucleus is not None:
            self.out.nucleus_log_mass = nucleus_log_mass(self.out, self.nucleus)
        if self.sampling_mask:
            self.out.nucleus_log_mass = kept_set_log_mass(self.out)
        return self.out


class StreamErrorEvent(Exception):
    """An ``{"error": {...}}`` event in a stream; ``retryable`` follows the event (or its HTTP-like code)."""

    def __init__(self, err: Any) -> None:
        err = err if isinstance(err, dict) else {"message": str(err)}
        self.message = str(err.get("message", ""))
        self.code = err.get("code")
        r = err.get("retryable")
        self.retryable = bool(r) if r is not None else (isinstance(self.code, int) and
                                                        (self.code >= 500 or self.code in (408, 429)))
        super().__init__(f"stream error event (code={self.code}): {self.message}")
