"""Tree verification: multi-candidate recursive rejection sampling and the greedy fast path.

Pure functions with the randomness passed in (docs/design.md), for a draft tree described by
`specdecode.tree.TreeBuffers` (node 0 = root = pending token). Row i of target_probs is the target's
processed next-token distribution after the path root..i, i.e. the distribution of node i's children;
row i of draft_probs is the distribution the draft sampled node i's children from.

Both verifiers walk down from the root. At node v they try v's children in order; an accepted child
becomes the next v; when no child is accepted (or v is a leaf) they emit one more token of the target's:
the recovered token (some child was rejected) or the bonus token (v is a leaf). Output tokens =
tokens of the accepted nodes + that token, so always >= 1. On a chain they are chain speculative sampling and
its greedy fast path, uniform for uniform (tested against the chain verifiers of tests/reference_verify.py).
"""

from __future__ import annotations

import torch

from specdecode.sampling import sample_from_probs
from specdecode.tree.buffers import TreeBuffers


def _reject_residual(
    residual: torch.Tensor, mass: float, draft_row: torch.Tensor | None, token: int
) -> torch.Tensor:
    """Unnormalised residual after rejecting `token`. residual: [V] with total `mass`; returns [V].

    Stochastic: mass * max(residual / mass - draft_row, 0) = max(residual - mass * draft_row, 0).
    Point mass (draft_row None): the same with draft_row = one-hot(token), i.e. zero that token.
    Kept unnormalised (sample_from_probs normalises) so that on a chain the first rejection computes exactly the
    residual of chain speculative sampling.
    """
    if draft_row is None:
        out = residual.clone()
        out[token] = 0.0
        return out
    return (residual - mass * draft_row).clamp_min(0.0)  # [V]


def _check_shapes(n: int, tokens: torch.Tensor, rows: dict[str, torch.Tensor | None]) -> None:
    if tokens.shape != (n,):
        raise ValueError(f"tokens must have shape [{n}] for a tree of {n} nodes, got {list(tokens.shape)}")
    for name, tensor in rows.items():
        if tensor is not None and (tensor.dim() == 0 or tensor.shape[0] != n):
            raise ValueError(f"{name} needs one row per tree node ({n}), got shape {list(tensor.shape)}")


def verify_tree(
    tokens: torch.Tensor,
    buffers: TreeBuffers,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[list[int], torch.Tensor]:
    """Lossless tree verification by recursive (multi-candidate) rejection sampling (SpecInfer style).

    tokens: LongTensor [n], tokens[0] = the pending root token (not verified), tokens[i] = draft token
    of node i. draft_probs: [n, V], row v = the draft distribution node v's children were sampled from
    (rows of leaves are ignored), or None for deterministic children (point masses, e.g. the draft's
    top-b tokens). target_probs: [n, V] processed target distributions, each row normalised (as from
    `logits_to_probs`). uniforms: [n] (longer is fine; only the first n are read) in [0, 1):
    uniforms[c] decides the acceptance of node c, read only if c is tried, and uniforms[0] samples the
    final token. Each node is tried at most once, so the decisions use independent uniforms.

    Rule at node v with children c1..cm (in order) and residual r = target_probs[v]:
    - child c with token x and proposal q (q = draft_probs[v], or one-hot(x) for a point mass):
      accept iff u_c * q[x] < r[x] (r normalised), i.e. with probability min(1, r[x] / q[x]);
      r[x] == 0 always rejects, q[x] == 0 < r[x] always accepts, a point mass accepts w.p. r[x].
    - on rejection r <- normalise(max(r - q, 0)); for a point mass that zeroes r[x] and renormalises.
      (If that leaves no mass, which only float error can cause, r is kept.)
    - accepted child: emit its token, move to it, restart with r = target_probs[child];
      all children rejected, or v a leaf: emit a token sampled from r (for a leaf, target_probs[v]).

    Exactness (by induction on the number of children left, then on depth). Claim: at node v, with
    children still to try drawn as below, the emitted token is distributed as r. No child left: we
    sample from r. Otherwise, for the first remaining child x ~ q:
      P(emit y) = q(y) min(1, r(y)/q(y)) + P(reject) r'(y) = min(q, r)(y) + max(r - q, 0)(y) = r(y),
    since P(reject) = sum(max(r - q, 0)) and r' = max(r - q, 0) / P(reject) is, by induction, the law
    of what the remaining children emit -- this needs the remaining children to be independent of the
    first child and of its uniform, and to be drawn from the q used in the rule. Hence the rule is
    exact for:
    - stochastic children sampled i.i.d. (WITH replacement, duplicates allowed) from draft_probs[v];
      the same q serves every sibling. It is NOT exact for sampling without replacement (that needs
      each sibling's q renormalised over the tokens not drawn yet).
    - point-mass children: any deterministic tokens (distinct in practice; a duplicate of a rejected
      token is rejected again since its r is 0), with q = one-hot of each child's own token.
    Given the emitted token is child c's, the path continues in c's subtree, whose children were drawn
    from the draft at c independently of everything at v, and r restarts at target_probs[c], the
    target's distribution after the longer path: so the emitted sequence has the target's law.

    Returns (accepted_nodes, output_tokens): accepted node indices (root excluded) in path order, which
    the engine keeps when compacting the KV cache, and LongTensor [a+1] of their tokens followed by the
    recovered or bonus token, on target_probs' device.
    """
    n = buffers.num_nodes
    _check_shapes(n, tokens, {"draft_probs": draft_probs, "target_probs": target_probs})
    if uniforms.dim() != 1 or uniforms.shape[0] < n:
        raise ValueError(f"uniforms needs at least {n} entries (one per node), got shape {list(uniforms.shape)}")

    # Python scalars: the walk touches at most (sum of children on one path) nodes, and the comparisons
    # run in float64 on exact float32 values.
    token_list = tokens.tolist()
    u = uniforms[:n].tolist()
    accepted: list[int] = []
    node = 0
    while True:
        residual = target_probs[node]  # [V]
        mass = 1.0  # rows of target_probs are normalised; residuals after a rejection are not
        draft_row = None if draft_probs is None else draft_probs[node]  # [V] or None
        next_node = -1
        for child in buffers.children[node]:
            x = token_list[child]
            draft_p = 1.0 if draft_row is None else float(draft_row[x])
            # u < min(1, (r[x]/mass) / q[x]), written as a product: no division by zero.
            if u[child] * draft_p * mass < float(residual[x]):
                next_node = child
                break
            candidate = _reject_residual(residual, mass, draft_row, x)  # [V]
            candidate_mass = float(candidate.sum())
            if candidate_mass > 0.0:
                residual, mass = candidate, candidate_mass
        if next_node < 0:
            break
        accepted.append(next_node)
        node = next_node

    final = int(sample_from_probs(residual, u[0]))  # recovered (some child rejected) or bonus (leaf)
    out = [token_list[c] for c in accepted] + [final]
    return accepted, torch.tensor(out, dtype=torch.long, device=target_probs.device)  # [a+1]


def verify_tree_greedy(
    tokens: torch.Tensor, buffers: TreeBuffers, target_argmax: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Greedy fast path: follow the children whose token equals the target's argmax.

    tokens: LongTensor [n] (tokens[0] = pending root token); target_argmax: LongTensor [n], entry i =
    the target's argmax after the path root..i (its prediction for node i's child). At node v the
    first child (in order) whose token equals target_argmax[v] is accepted; the walk stops at a node
    with no such child. Returns (accepted_nodes, output_tokens [a+1]) = (accepted node indices in path
    order, their tokens + target_argmax[last accepted node or root]). Equals `verify_tree` with a
    point-mass draft and one-hot target_probs.
    """
    n = buffers.num_nodes
    _check_shapes(n, tokens, {"target_argmax": target_argmax})
    token_list = tokens.tolist()
    argmax = target_argmax.tolist()
    accepted: list[int] = []
    node = 0
    while True:
        want = argmax[node]
        next_node = next((c for c in buffers.children[node] if token_list[c] == want), -1)
        if next_node < 0:
            break
        accepted.append(next_node)
        node = next_node
    out = [token_list[c] for c in accepted] + [argmax[node]]
    return accepted, torch.tensor(out, dtype=torch.long, device=target_argmax.device)  # [a+1]
