"""Greedy (or sampled) decoding of Llama-architecture targets with a static KV cache, one step replayed as
a CUDA graph.

transformers' `generate` spends each step of a small target in Python, not on the GPU, whatever the
batch size (docs/perf.md compares the two: `bench/regenerate.py`). Here the prompt goes through the model's own forward
(prefill, in row groups that fit in memory) and its keys/values are copied into a static cache of
prompt + max_new_tokens slots; one decode step (embedding, every layer, final norm, lm_head,
argmax) is captured once per batch shape as a CUDA graph and replayed. On CPU the same step runs
eagerly (that is what the tests compare with `generate`).

Rows are left padded, so every row writes the same cache slot each step; a row's mask is its own
prompt span plus the slots written so far, and its positions count from its first real token,
exactly as `generate` does with an attention mask. With temperature > 0 each token is a sample of
softmax(logits / temperature) instead of the argmax (`pick`: the Gumbel-max trick, one fixed-shape op
that a CUDA graph replays with fresh noise each step). ContinuousGreedy keeps a fixed set of rows
busy instead, refilling each as its answer ends; its rows sit at different positions, so each writes
its own slot. Only the plain Llama decoder layer is supported (`supports`); other targets use
`generate`.
"""
from __future__ import annotations

import time
from typing import Any, List, Sequence, Tuple

import torch


def supports(model) -> bool:
    c = model.config
    return (c.model_type == "llama" and not getattr(c, "attention_bias", False)
            and not getattr(c, "mlp_bias", False) and getattr(c, "hidden_act", "silu") == "silu"
            and hasattr(model, "model") and hasattr(model.model, "rotary_emb"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def pick(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    """The next token of each row of logits [..., V]: the argmax, or with temperature > 0 a sample of
    softmax(logits / temperature), drawn as argmax(logits / temperature - log E) with E ~ Exp(1)
    per entry (the Gumbel-max trick: -log E is Gumbel noise)."""
    if temperature <= 0:
        return logits.argmax(-1)
    e = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
    return (logits.float() / temperature - e.clamp_min(torch.finfo(torch.float32).tiny).log()).argmax(-1)


class StaticGreedy:
    """greedy(prompts) -> generated ids per prompt (max_new_tokens each, stop tokens included).
    temperature > 0 samples each token instead (`pick`)."""

    def __init__(self, model, max_new_tokens: int, pad_id: int, temperature: float = 0.0):
        if not supports(model):
            raise ValueError(f"StaticGreedy supports plain Llama decoders, not {model.config.model_type!r}")
        if temperature < 0:
            raise ValueError(f"temperature {temperature}: expected 0 (greedy) or more")
        c = model.config
        self.model, self.max_new, self.pad_id, self.temperature = model, max_new_tokens, pad_id, float(temperature)
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // self.nh
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def cache_bytes_per_token(self) -> int:
        return 2 * len(self.model.model.layers) * self.nkv * self.hd * self.dtype.itemsize

    # ---- one decode step: token ids [B] at positions [B], written to cache slot `slot` [1] ----
    def _step(self, ids, pos, slot, keys, values, valid, arange):
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=ids.device)
        bias = bias.masked_fill(~(valid & (arange <= slot)), float("-inf"))             # [B, T]
        return self._decode(ids, pos, bias, keys, values, lambda K, k: K.index_copy_(2, slot, k))

    def _decode(self, ids, pos, bias, keys, values, write):
        """Next token [B] after ids [B] at positions pos [B]. write(K, k) stores a layer's new
        key/value k [B, nkv, 1, hd] in its cache [B, nkv, T, hd]; bias [B, T] is -inf at the slots a
        row must not read."""
        m = self.model.model
        B, g = ids.shape[0], self.nh // self.nkv
        h = m.embed_tokens(ids)[:, None]                                   # [B, 1, H]
        cos, sin = m.rotary_emb(h, pos[:, None])                           # [B, 1, hd]
        cos, sin = cos[:, None], sin[:, None]                              # [B, 1, 1, hd]
        bias = bias[:, None, None]                                         # [B, 1, 1, T]
        for layer, K, V in zip(m.layers, keys, values):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(B, self.nh, 1, self.hd)
            k = a.k_proj(x).view(B, self.nkv, 1, self.hd)
            v = a.v_proj(x).view(B, self.nkv, 1, self.hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            write(K, k)
            write(V, v)
            # query head j*g..j*g+g-1 reads kv head j (transformers' repeat_kv order)
            s = torch.matmul(q.view(B, self.nkv, g, self.hd), K.transpose(-1, -2)).float() * a.scaling
            p = torch.softmax(s + bias, dim=-1).to(V.dtype)
            o = torch.matmul(p, V).reshape(B, 1, self.nh * self.hd)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return pick(self.model.lm_head(m.norm(h))[:, 0], self.temperature)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], prefill_tokens: int = 1 << 18,
                 stop_ids: Sequence[int] = ()) -> List[List[int]]:
        """One batch: left-pad, prefill, decode max_new_tokens (greedily, or sampled at the
        temperature; early exit once every row has produced a stop id)."""
        dev, B = self.device, len(prompts)
        ids, att = (t.to(dev) for t in left_pad(prompts, self.pad_id))
        T = ids.shape[1]
        S = T + self.max_new
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        layers = self.model.model.layers
        keys = [torch.zeros(B, self.nkv, S, self.hd, dtype=self.dtype, device=dev) for _ in layers]
        values = [torch.zeros_like(k) for k in keys]
        out = torch.empty(B, self.max_new, dtype=torch.long, device=dev)
        rows = max(1, prefill_tokens // T)
        for r0 in range(0, B, rows):                   # prefill in row groups that fit in memory
            sl = slice(r0, r0 + rows)
            res = self.model(input_ids=ids[sl], attention_mask=att[sl], position_ids=pos[sl],
                             use_cache=True, logits_to_keep=1)
            for i, layer_cache in enumerate(res.past_key_values.layers):
                keys[i][sl, :, :T] = layer_cache.keys
                values[i][sl, :, :T] = layer_cache.values
            out[sl, 0] = pick(res.logits[:, -1], self.temperature)
            del res
        valid = torch.cat([att.bool(), torch.ones(B, self.max_new, dtype=torch.bool, device=dev)], 1)
        arange = torch.arange(S, device=dev)
        cur = out[:, 0].clone()
        cur_pos = pos[:, -1] + 1
        slot = torch.tensor([T], dtype=torch.long, device=dev)
        step = self._replayable(cur, cur_pos, slot, keys, values, valid, arange)
        stops = torch.tensor(list(stop_ids) or [-1], device=dev)
        for j in range(1, self.max_new):
            out[:, j] = step()
            cur.copy_(out[:, j])
            cur_pos.add_(1)
            slot.add_(1)
            if stop_ids and j % 32 == 31 and bool(torch.isin(out[:, :j + 1], stops).any(-1).all()):
                out = out[:, :j + 1]
                break
        return out.tolist()

    def _replayable(self, *args, step=None):
        """A no-argument callable running one step (self._step unless given) on the static buffers `args`."""
        step = step or self._step
        if self.device.type != "cuda":
            return lambda: step(*args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                  # warm-up; its cache writes are redone by the replays
            step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                result = step(*args)
        except RuntimeError as e:                       # still correct, only slower
            print(f"[fastgen] CUDA graph capture failed ({e}); decoding eagerly", flush=True)
            return lambda: step(*args)

        def replay():
            graph.replay()
            return result
        return replay


class ContinuousGreedy(StaticGreedy):
    """Greedy decoding over a fixed number of rows (slots), each refilled with a waiting prompt as soon
    as its answer is done, so that no step runs on a row that has nothing left to write.

    A row holds its prompt at cache slots 0..len-1 and writes the key/value of the token at position p
    to slot p: its write index is its own position `pos` [rows], a static buffer that the step advances
    in place, so one captured graph serves every step whatever each row is at. The mask is
    arange <= pos, which also hides what an earlier occupant left in the slots past it. add() prefills
    new prompts (right padded, several at once, with the model's own forward) into free rows; advance()
    runs check_every steps and returns the rows that are done. Each check reads the rows' state back to
    the host (a sync, then the refill's prefill while the graph waits); between checks a row that has
    stopped runs on for up to check_every - 1 steps whose tokens are dropped. The cache holds
    rows x (max_prompt + max_new_tokens) tokens, allocated once; compact() drops the free rows when
    no more prompts are coming, since a step costs every row's whole cache, busy or not.

        dec = ContinuousGreedy(model, 256, max_prompt=2047, rows=1024, pad_id=pad, stop_ids=stop)
        dec.add([(key, prompt), ...]); finished = dec.advance()     # [(key, ids up to the stop id)]
    """

    def __init__(self, model, max_new_tokens: int, max_prompt: int, rows: int, pad_id: int,
                 stop_ids: Sequence[int] = (), check_every: int = 16, prefill_tokens: int = 1 << 18,
                 temperature: float = 0.0):
        super().__init__(model, max_new_tokens, pad_id, temperature)
        dev, B, S = self.device, rows, max_prompt + max_new_tokens
        self.rows, self.max_prompt = rows, max_prompt
        self.check_every, self.prefill_tokens = check_every, prefill_tokens
        self.stop_ids = [int(t) for t in stop_ids]
        self.owner: List[Any] = [None] * B             # what each row answers; None: free
        layers = self.model.model.layers
        self.keys = [torch.zeros(B, self.nkv, S, self.hd, dtype=self.dtype, device=dev) for _ in layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.cur = torch.zeros(B, dtype=torch.long, device=dev)        # last token, at position pos
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)        # = the cache slot it is written to
        self.n = torch.zeros(B, dtype=torch.long, device=dev)          # tokens generated so far
        self.hit = torch.zeros(B, dtype=torch.bool, device=dev)        # a stop id among them
        self.out = torch.zeros(B, max_new_tokens + 1, dtype=torch.long, device=dev)   # last column: overrun
        self.stops = torch.tensor(self.stop_ids or [-1], device=dev)
        self.arange = torch.arange(S, device=dev)
        self._capture()                              # while every row is free: the warm-up step
        for t in (self.cur, self.pos, self.n, self.hit):     # wrote to no row in use
            t.zero_()
        # where the time goes (pace()): decode steps run, prompts prefilled, seconds in each
        self.steps, self.prefilled, self.decode_s, self.prefill_s = 0, 0, 0.0, 0.0

    def _capture(self) -> None:
        """The step on the current buffers, as a graph on CUDA. Capturing runs the step once for real
        (its warm-up): every busy row decodes one token, exactly as a replay would."""
        self._replay = None                          # the old graph's memory goes before the new one's
        self._replay = self._replayable(step=self._step_rows)

    def compact(self, multiple: int = 8) -> bool:
        """Fewer rows: the busy ones (with free ones up to a multiple of `multiple`), their caches and
        state moved over, the step captured again. A step costs every row's whole cache whether the
        row is busy or not, so once no more prompts can come (the last conversations' turns) the
        batch shrinks with them. True if it shrank."""
        busy = [r for r, o in enumerate(self.owner) if o is not None]
        rows = max(multiple, -(-len(busy) // multiple) * multiple)
        if rows >= self.rows:
            return False
        keep = busy + [r for r, o in enumerate(self.owner) if o is None][:rows - len(busy)]
        idx = torch.tensor(keep, device=self.device)
        self.cur, self.pos, self.n, self.hit, self.out = (t[idx] for t in (self.cur, self.pos, self.n, self.hit,
                                                                          self.out))
        self.keys = [k[idx] for k in self.keys]
        self.values = [v[idx] for v in self.values]
        self.owner = [self.owner[r] for r in keep]
        self.rows = rows
        self._capture()
        return True

    def _step_rows(self):
        """One step of every row on the static buffers; a finished or free row computes on, its
        position held at the last slot and its count at max_new_tokens (their tokens are dropped)."""
        B, S = self.cur.shape[0], self.arange.shape[0]
        bias = torch.zeros(B, S, dtype=torch.float32, device=self.cur.device)
        bias = bias.masked_fill(self.arange > self.pos[:, None], float("-inf"))
        at = self.pos.view(B, 1, 1, 1).expand(B, self.nkv, 1, self.hd)   # row b writes slot pos[b]
        tok = self._decode(self.cur, self.pos, bias, self.keys, self.values, lambda K, k: K.scatter_(2, at, k))
        self.out.scatter_(1, self.n[:, None], tok[:, None])
        self.hit |= (tok[:, None] == self.stops).any(-1)
        self.n.add_(1).clamp_(max=self.max_new)
        self.pos.add_(1).clamp_(max=S - 1)
        self.cur.copy_(tok)
        return tok

    def free(self) -> int:
        return sum(o is None for o in self.owner)

    def busy(self) -> int:
        return len(self.owner) - self.free()

    @torch.no_grad()
    def add(self, items: Sequence[Tuple[Any, Sequence[int]]]) -> None:
        """Start answering (key, prompt) pairs, at most free() of them, each prompt max_prompt tokens
        at most: prefill in row groups of about prefill_tokens, keys/values copied to slots 0..len-1."""
        if not items:
            return
        rows = [r for r, o in enumerate(self.owner) if o is None][:len(items)]
        if len(rows) < len(items):
            raise ValueError(f"{len(items)} prompts for {len(rows)} free rows")
        if any(len(p) > self.max_prompt for _, p in items):
            raise ValueError(f"a prompt is longer than max_prompt={self.max_prompt}")
        m, dev = self.model, self.device
        t0 = time.perf_counter()
        step = max(1, self.prefill_tokens // max(len(p) for _, p in items))
        for g in range(0, len(items), step):
            group, r = items[g:g + step], torch.tensor(rows[g:g + step], device=dev)
            lens = torch.tensor([len(p) for _, p in group], device=dev)
            ids, att = (t.to(dev) for t in right_pad([p for _, p in group], self.pad_id))
            T = ids.shape[1]
            # right padded: a prompt's tokens never attend to the padding after them, and sit at
            # positions 0..len-1, the slots they are copied to
            res = m.model(input_ids=ids, attention_mask=att, use_cache=True,
                          position_ids=torch.arange(T, device=dev).expand_as(ids))
            first = pick(m.lm_head(res.last_hidden_state[torch.arange(len(group), device=dev), lens - 1]),
                         self.temperature)
            for i, layer_cache in enumerate(res.past_key_values.layers):
                self.keys[i][r, :, :T] = layer_cache.keys
                self.values[i][r, :, :T] = layer_cache.values
            del res
            self.cur[r], self.pos[r], self.n[r] = first, lens, 1
            self.out[r, 0] = first
            self.hit[r] = (first[:, None] == self.stops).any(-1)
        for row, (key, _) in zip(rows, items):
            self.owner[row] = key
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)                # timed apart from the steps that follow
        self.prefilled += len(items)
        self.prefill_s += time.perf_counter() - t0

    @torch.no_grad()
    def advance(self) -> List[Tuple[Any, List[int]]]:
        """check_every decode steps, then (key, generated ids) of every row that is done: up to and
        including its first stop id, or max_new_tokens ids. Those rows are free again."""
        t0 = time.perf_counter()
        for _ in range(self.check_every):
            self._replay()
        state = torch.where(self.hit | (self.n >= self.max_new), self.n, 0).tolist()    # one sync
        self.steps += self.check_every
        self.decode_s += time.perf_counter() - t0
        rows = [r for r, k in enumerate(state) if k and self.owner[r] is not None]
        if not rows:
            return []
        done = []
        for r, ids in zip(rows, self.out[torch.tensor(rows, device=self.device)].tolist()):
            ids = ids[:state[r]]
            stop = next((j for j, t in enumerate(ids) if t in self.stop_ids), None)
            done.append((self.owner[r], ids if stop is None else ids[:stop + 1]))
            self.owner[r] = None
        return done

    def pace(self) -> str:
        """Where the time went so far: decode steps (each with its share of the checks' syncs) and
        refill prefills."""
        ms = 1e3 * self.decode_s / max(1, self.steps)
        return (f"{self.steps} steps at {ms:.1f} ms, {self.prefilled} prompts prefilled in "
                f"{self.prefill_s:.1f} s")

    def generate(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
        """Every prompt's answer, in order (each up to and including its first stop id)."""
        out: List[List[int]] = [[] for _ in prompts]
        waiting = list(enumerate(prompts))[::-1]
        while waiting or self.busy():
            self.add([waiting.pop() for _ in range(min(self.free(), len(waiting)))])
            for i, ids in self.advance():
                out[i] = ids
        return out


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    """(ids, attention mask), both [B, longest] int64 on CPU, each prompt right-aligned."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    att = torch.zeros(len(prompts), T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor(p, dtype=torch.long)
        att[r, T - len(p):] = 1
    return ids, att


def right_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    """(ids, attention mask), both [B, longest] int64 on CPU, each prompt left-aligned."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    att = torch.zeros(len(prompts), T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        att[r, :len(p)] = 1
    return ids, att


def batches_by_memory(lengths: Sequence[int], max_new: int, max_batch: int, bytes_per_token: int,
                      budget_bytes: int) -> List[List[int]]:
    """Prompt indices grouped longest first so that each group's static cache fits budget_bytes."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, b = [], 0
    while b < len(order):
        S = lengths[order[b]] + max_new
        n = max(1, min(max_batch, budget_bytes // (S * bytes_per_token)))
        groups.append(order[b:b + n])
        b += n
    return groups

