// Package placement chooses which GPUs of a node a request goes to: the
// node allocator the Kubernetes parts share. It knows GPUs only as cards
// with free core and memory, nothing of pods or of the kubelet.
//
// A request for 1..99 core is a share of one card: the card must have that
// much core and memory free. A request for a multiple of 100 is that many
// whole cards, each entirely free. Across the cards that fit, the policy
// decides, as the node label ack.node.gpu.placement does in ACK: binpack
// fills the fullest card first, spread the emptiest.
package placement

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// WholeCore is the core of one whole GPU.
const WholeCore = 100

// Card is the state of one GPU.
type Card struct {
	Index         int    // NVML index
	UUID          string // GPU-...
	MemoryMiB     uint64 // the card's memory
	MemoryFreeMiB uint64 // memory no instance holds
	CoreFree      int    // 100 - the sum of the card's instances' core
	Instances     int    // instances on the card
}

// free reports whether no instance uses the card.
func (c Card) free() bool { return c.Instances == 0 && c.CoreFree == WholeCore }

// Request is what one container asks of the node.
type Request struct {
	// Core is a percent of one GPU (1..99), or a multiple of 100 for
	// whole GPUs.
	Core int
	// MemoryMiB is the memory asked of each GPU. It is required for a
	// share of one GPU; for whole GPUs 0 means all of each.
	MemoryMiB uint64
}

// Policy says which of the cards that fit a share of one GPU goes to.
type Policy int

const (
	// Binpack puts a share on the card it leaves fullest, keeping other
	// cards free for large requests (the default).
	Binpack Policy = iota
	// Spread puts a share on the emptiest card, so shares meet fewer
	// neighbours.
	Spread
)

var policyNames = [...]string{"binpack", "spread"}

// String returns the label value of the policy ("binpack", "spread").
func (p Policy) String() string {
	if p >= 0 && int(p) < len(policyNames) {
		return policyNames[p]
	}
	return fmt.Sprintf("policy(%d)", int(p))
}

// ParsePolicy reads a value of the node label ack.node.gpu.placement; an
// empty value is Binpack.
func ParsePolicy(s string) (Policy, error) {
	if s == "" {
		return Binpack, nil
	}
	for i, n := range policyNames {
		if s == n {
			return Policy(i), nil
		}
	}
	return 0, fmt.Errorf("unknown placement %q (want %s)", s, strings.Join(policyNames[:], " or "))
}

// RequestError is a request that no node could ever satisfy; Field names
// the part at fault ("core" or "memory").
type RequestError struct {
	Field string
	Msg   string
}

func (e *RequestError) Error() string { return "invalid request: " + e.Field + " " + e.Msg }

// NoFitError is a valid request that none of the cards can take now.
type NoFitError struct {
	Request Request
	Cards   []Card
	// CoreOnly is set when memory was not known (PlaceCore).
	CoreOnly bool
}

func (e *NoFitError) Error() string {
	var b strings.Builder
	k := e.Request.Core / WholeCore
	switch {
	case e.Request.Core < WholeCore && e.CoreOnly:
		fmt.Fprintf(&b, "no GPU has %d%% core free", e.Request.Core)
	case e.Request.Core < WholeCore:
		fmt.Fprintf(&b, "no GPU has %d%% core and %d MiB free", e.Request.Core, e.Request.MemoryMiB)
	case k == 1:
		b.WriteString("no GPU is entirely free")
	default:
		fmt.Fprintf(&b, "fewer than %d GPUs are entirely free", k)
	}
	if e.Request.Core >= WholeCore && e.Request.MemoryMiB > 0 && !e.CoreOnly {
		fmt.Fprintf(&b, " with %d MiB", e.Request.MemoryMiB)
	}
	if len(e.Cards) == 0 {
		b.WriteString(" (the node has no GPU)")
		return b.String()
	}
	b.WriteString(" (")
	for i, c := range e.Cards {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "GPU %d: %d%%", c.Index, c.CoreFree)
		if !e.CoreOnly {
			fmt.Fprintf(&b, " and %d MiB", c.MemoryFreeMiB)
		}
		b.WriteString(" free")
		if e.Request.Core >= WholeCore {
			fmt.Fprintf(&b, ", %d instance", c.Instances)
			if c.Instances != 1 {
				b.WriteString("s")
			}
		}
	}
	b.WriteString(")")
	return b.String()
}

// Place returns the indexes of the cards req goes to: one card for a share
// (1..99 core), core/100 entirely free cards, lowest indexes first, for
// whole GPUs. Errors are *RequestError or *NoFitError. The same input gives
// the same answer.
func Place(cards []Card, req Request, p Policy) ([]int, error) {
	if err := validate(req, p, true); err != nil {
		return nil, err
	}
	return place(cards, req, p, false)
}

// PlaceCore is Place for a caller that does not know the request's memory
// (the device plugin's preferred allocation): only core is considered, the
// cards' memory is ignored and never breaks ties.
func PlaceCore(cards []Card, core int, p Policy) ([]int, error) {
	req := Request{Core: core}
	if err := validate(req, p, false); err != nil {
		return nil, err
	}
	return place(cards, req, p, true)
}

func validate(req Request, p Policy, needMemory bool) error {
	switch {
	case req.Core <= 0:
		return &RequestError{"core", fmt.Sprintf("%d: must be 1..99 (percent of one GPU) or a multiple of 100 (whole GPUs)", req.Core)}
	case req.Core > WholeCore && req.Core%WholeCore != 0:
		return &RequestError{"core", fmt.Sprintf("%d: above 100 it must be a multiple of 100 (whole GPUs)", req.Core)}
	case needMemory && req.Core < WholeCore && req.MemoryMiB == 0:
		return &RequestError{"memory", fmt.Sprintf("0 MiB: a share of %d%% of one GPU needs a memory quota", req.Core)}
	case p != Binpack && p != Spread:
		return fmt.Errorf("unknown placement %v", p)
	}
	return nil
}

func place(cards []Card, req Request, p Policy, coreOnly bool) ([]int, error) {
	sorted := slices.Clone(cards)
	slices.SortStableFunc(sorted, func(a, b Card) int { return cmp.Compare(a.Index, b.Index) })
	memFits := func(c Card) bool { return coreOnly || c.MemoryFreeMiB >= req.MemoryMiB }
	if req.Core >= WholeCore {
		// Whole cards cannot be spread: both policies take the lowest
		// indexes that are entirely free.
		k := req.Core / WholeCore
		var out []int
		for _, c := range sorted {
			if c.free() && memFits(c) {
				out = append(out, c.Index)
				if len(out) == k {
					return out, nil
				}
			}
		}
		return nil, &NoFitError{Request: req, Cards: sorted, CoreOnly: coreOnly}
	}
	best := -1
	for i, c := range sorted {
		if c.CoreFree < req.Core || !memFits(c) {
			continue
		}
		if best < 0 || better(c, sorted[best], p, coreOnly) {
			best = i
		}
	}
	if best < 0 {
		return nil, &NoFitError{Request: req, Cards: sorted, CoreOnly: coreOnly}
	}
	return []int{sorted[best].Index}, nil
}

// better reports whether a share should go to card a rather than card b,
// both of which fit and b of a lower or equal index. Binpack prefers the
// least free core (then memory) left after placement, spread the most; the
// request is the same for both cards, so comparing what they have free now
// orders them as what they would have left.
func better(a, b Card, p Policy, coreOnly bool) bool {
	c := cmp.Compare(a.CoreFree, b.CoreFree)
	if c == 0 && !coreOnly {
		c = cmp.Compare(a.MemoryFreeMiB, b.MemoryFreeMiB)
	}
	if p == Spread {
		c = -c
	}
	return c < 0 // on a tie the lower index (b) stays
}
