package placement

import (
	"fmt"
	"slices"
)

// maxNearCombinations bounds PlaceNear's exhaustive search (C(16,8) =
// 12870: every node of up to 16 GPUs is searched exhaustively); beyond it
// the choice is greedy.
const maxNearCombinations = 1 << 16

// PlaceNear chooses k whole GPUs among free (GPU indexes, each wholly
// free), including every GPU of must, so that they are as near each other
// as the node's topology allows (ACK's topology-aware mode): the smallest
// sum of dist over all pairs, then the smallest largest dist, then the
// lowest indexes. dist(a, b) is the rank of the link between GPUs a and b
// (0 for the same GPU, larger is farther), symmetric. The same input gives
// the same answer. Errors are *RequestError or *NoFitError.
func PlaceNear(free, must []int, k int, dist func(a, b int) int) ([]int, error) {
	if k < 1 {
		return nil, &RequestError{"gpus", fmt.Sprintf("%d: must be at least 1", k)}
	}
	pool := slices.Clone(free)
	for _, g := range must {
		if !slices.Contains(pool, g) {
			pool = append(pool, g)
		}
	}
	slices.Sort(pool)
	pool = slices.Compact(pool)
	must = slices.Compact(slices.Sorted(slices.Values(must)))
	if len(must) > k {
		return nil, &RequestError{"gpus", fmt.Sprintf("%d must-include GPUs for %d", len(must), k)}
	}
	if len(pool) < k {
		cards := make([]Card, len(pool))
		for i, g := range pool {
			cards[i] = Card{Index: g, CoreFree: WholeCore}
		}
		return nil, &NoFitError{Request: Request{Core: k * WholeCore}, Cards: cards, CoreOnly: true}
	}
	var rest []int
	for _, g := range pool {
		if !slices.Contains(must, g) {
			rest = append(rest, g)
		}
	}
	need := k - len(must)
	score := func(set []int) (sum, worst int) {
		for i := range set {
			for j := i + 1; j < len(set); j++ {
				d := dist(set[i], set[j])
				sum += d
				worst = max(worst, d)
			}
		}
		return sum, worst
	}
	better := func(a, b []int) bool {
		sa, wa := score(a)
		sb, wb := score(b)
		if sa != sb {
			return sa < sb
		}
		if wa != wb {
			return wa < wb
		}
		return slices.Compare(a, b) < 0
	}
	var best []int
	if binomial(len(rest), need) <= maxNearCombinations {
		combinations(rest, need, func(c []int) {
			set := slices.Sorted(slices.Values(append(slices.Clone(must), c...)))
			if best == nil || better(set, best) {
				best = set
			}
		})
		return best, nil
	}
	// Greedy: from the must-include GPUs (else each GPU as a start), add
	// the GPU that adds the least distance, lowest index on a tie.
	starts := [][]int{must}
	if len(must) == 0 {
		starts = nil
		for _, g := range rest {
			starts = append(starts, []int{g})
		}
	}
	for _, start := range starts {
		set := slices.Clone(start)
		for len(set) < k {
			pick, cost := -1, 0
			for _, g := range rest {
				if slices.Contains(set, g) {
					continue
				}
				c := 0
				for _, s := range set {
					c += dist(s, g)
				}
				if pick < 0 || c < cost {
					pick, cost = g, c
				}
			}
			set = append(set, pick)
		}
		slices.Sort(set)
		if best == nil || better(set, best) {
			best = set
		}
	}
	return best, nil
}

// binomial is C(n, k), saturating above maxNearCombinations.
func binomial(n, k int) int {
	if k < 0 || k > n {
		return 0
	}
	c := 1
	for i := 1; i <= k; i++ {
		c = c * (n - k + i) / i
		if c > maxNearCombinations {
			return maxNearCombinations + 1
		}
	}
	return c
}

// combinations calls f with every k-subset of s, in lexicographic order
// (the slice is reused between calls).
func combinations(s []int, k int, f func([]int)) {
	c := make([]int, 0, k)
	var rec func(from int)
	rec = func(from int) {
		if len(c) == k {
			f(c)
			return
		}
		for i := from; i <= len(s)-(k-len(c)); i++ {
			c = append(c, s[i])
			rec(i + 1)
			c = c[:len(c)-1]
		}
	}
	rec(0)
}
