"""LRAgent trajectories teacher-forced through the batch engine (bench/lragent.py
`--via=engine`, bench/composed.py).

The batch-1 evaluation (`AgentRunner.run`) walks one trajectory call by call: the
context its scheme makes the call's role compute is prefilled with the role's
adapter, then the call's gold tokens are fed back, scoring each one's log-probability
and the greedy token at each step.

Here every trajectory is one session of the engine's `agents` mechanism (or of a
composition laid out by it, e.g. `agents+pruned`), and each call is a teacher-forced
request on its role's adapter: prompt = the trajectory before the call, forced = the
call's gold tokens. The session's region holds what earlier calls left (the scheme
decides whose), so the call prefills only what the runner's call computes. The calls
of one trajectory go in order (each reads what the one before it wrote); up to
`max_batch` trajectories run at once, their calls batched in the engine's rows.

Against the runner, a call's gold tokens are fed as prefill chunks (the runner
decodes them one step at a time) and prompts are chunked as the engine chunks them,
so log-probabilities can differ in the last bits (tests/test_evaluation_agents.py
bounds them at 1e-5); greedy tokens and the prefilled counts are the runner's. TTFT
here includes the wait behind other rows: timing stays with the runner.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from jaxkv.config import PAGE_SIZE, CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine import executables
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.agents import SERVED, Agents
from jaxkv.engine.request import Request, Result
from jaxkv.kv.state import SENTINEL
from jaxkv.policies.sharing import lragent


@dataclasses.dataclass
class Served:
  """One trajectory's outcome: its index in the list served, one engine `Result` per
  call in trajectory order (`logprob`, `argmax` over the call's gold tokens, `extra`:
  the mechanisms' usage, e.g. `computed_tokens`), and the live slots its session's
  regions held when its last call ended (holes of a pruned trajectory not counted)."""
  index: int
  calls: list[Result]
  live_slots: int
  before: list[Result] = dataclasses.field(default_factory=list)  # run before its first call


def engine(llm, lora, scheme: str, *, max_tokens: int, max_batch: int = 4,
           prefill_chunk: int = 256, names: Sequence[str] = (),
           extra_pages: int = 0) -> tuple[Engine, Agents]:
  """An engine whose pool takes `max_batch` trajectories of up to `max_tokens` tokens
  under `scheme` (one of `SERVED`: a region per role for non_shared, one otherwise,
  plus a running call's own slots) and `extra_pages` more (another mechanism's session
  state, e.g. MemArt memory), with its `Agents` mechanism (sessions of `max_tokens`,
  `max_batch` open)."""
  if scheme not in SERVED:
    raise ValueError(f"the engine serves the sharing schemes {SERVED}, not {scheme!r}: "
                     "run it with jaxkv.engine.agents.AgentRunner")
  decoupled = scheme in lragent.DECOUPLED
  regions = lora.num_adapters if scheme == "non_shared" else 1
  pages = max_batch * (regions + 1) * (-(-max_tokens // PAGE_SIZE) + 1) + 8 + extra_pages
  eng = Engine(llm.model, llm.tokenizer.stop_ids,
               CacheConfig(num_pages=pages, page_size=PAGE_SIZE,
                           max_seq_len=max_tokens + PAGE_SIZE),
               EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk, decode_steps=16),
               lora=lora, lr_rank=lora.rank if decoupled else 0)
  mech = eng.add_mechanism(Agents(eng, scheme, names=names, max_tokens=max_tokens + PAGE_SIZE,
                                  max_sessions=max_batch))
  return eng, mech


def serve_trajectories(eng: Engine, agents: Agents, trajs: Sequence, *, mechanism: str = "agents",
                       contexts: Sequence[Sequence[dict]] | None = None, max_batch: int = 4,
                       progress=None,
                       before: Callable[[int, list[Result]], Request | None] | None = None,
                       prepare: Callable | None = None) -> Iterator[Served]:
  """Runs every trajectory (`jaxkv.data.agents.Trajectory`, first call at position >= 1)
  as a session of `agents` (the engine's mechanism, or the layout of the composition
  named `mechanism`), up to `max_batch` at once; yields each `Served` as its last call
  ends (so a caller can write results as they come), then closes its session.
  `contexts[t][k]`: extra `Request.context` of trajectory t's call k (a joined
  mechanism's, e.g. pruning's spans). `progress(calls)` after each call.
  `before(t, done)`: the next request to run once trajectory t's session is open and
  before its first call, given the `Result`s of those run so far (None: start the
  calls), e.g. the session's earlier conversation, then a composed MemArt session's
  recall; the results go to `prepare` and `Served.before`.
  `prepare(t, k, prompt, ctx, before)`: call k's (prompt, context) as the mechanism
  wants them (MemArt's region inserted), from the trajectory's own. Raises
  RuntimeError naming the call when one fails."""
  for traj in trajs:
    if not traj.calls or traj.calls[0].start < 1:
      raise ValueError(f"trajectory {traj.session}: its first agent call needs context before it")
  if len({traj.session for traj in trajs}) != len(trajs):
    raise ValueError("two trajectories share a session id")
  todo = collections.deque(range(len(trajs)))
  got: dict[int, list[Result]] = {}
  ran: dict[int, list[Result]] = {}    # the requests run before its calls

  def submit(t: int) -> None:
    traj, k = trajs[t], len(got[t])
    c = traj.calls[k]
    prompt = traj.ids[:c.start].tolist()
    ctx = {"session": traj.session, **(contexts[t][k] if contexts is not None else {})}
    if prepare is not None:
      prompt, ctx = prepare(t, k, prompt, ctx, ran[t])
    eng.submit(Request(f"{t}:{k}", prompt, SamplingConfig(max_tokens=1), adapter=c.role,
                       mechanism=mechanism, context=ctx,
                       forced=traj.ids[c.start:c.end].tolist()))

  def start_next() -> None:
    if todo:
      t = todo.popleft()
      agents.open(trajs[t].session)
      got[t], ran[t] = [], []
      opening(t)

  def opening(t: int) -> None:
    req = before(t, ran[t]) if before is not None else None
    if req is None:
      submit(t)
    else:
      eng.submit(dataclasses.replace(req, id=f"{t}:before"))

  for _ in range(max_batch):
    start_next()
  while eng.busy:
    for res in executables.step(eng):
      t, k = res.id.split(":")
      t = int(t)
      if k == "before":
        if res.error is not None or res.finish_reason not in ("stop", "length"):
          raise RuntimeError(f"{mechanism}: the request before trajectory {trajs[t].session} "
                             f"failed: {res.error or res.finish_reason}")
        ran[t].append(res)
        opening(t)
        continue
      k = int(k)
      if res.finish_reason != "length":
        raise RuntimeError(f"{mechanism}: call {k} of trajectory {trajs[t].session} failed: "
                           f"{res.error or res.finish_reason}")
      got[t].append(res)
      if progress is not None:
        progress(1)
      if k + 1 < len(trajs[t].calls):
        submit(t)
        continue
      s = agents.sessions[trajs[t].session]
      live = sum(int((eng.allocator.slot_map(r.seq) != SENTINEL).sum())
                 for r in s.regions.values())
      agents.close(trajs[t].session)
      yield Served(t, got.pop(t), live, ran.pop(t))
      start_next()
