package placement

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// card is a card of 80000 MiB with the given free core and memory; a card
// with all its core free has no instance, any other one.
func card(index, coreFree int, memFree uint64) Card {
	c := Card{Index: index, MemoryMiB: 80000, MemoryFreeMiB: memFree, CoreFree: coreFree}
	if coreFree < WholeCore {
		c.Instances = 1
	}
	return c
}

func TestParsePolicy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in string
		want     Policy
		err      string
	}{
		{name: "empty is binpack", in: "", want: Binpack},
		{name: "binpack", in: "binpack", want: Binpack},
		{name: "spread", in: "spread", want: Spread},
		{name: "unknown", in: "Spread", err: `unknown placement "Spread" (want binpack or spread)`},
		{name: "other", in: "topology", err: `unknown placement "topology" (want binpack or spread)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParsePolicy(tc.in)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err {
					t.Fatalf("ParsePolicy(%q) = %v, %v; want error %q", tc.in, got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParsePolicy(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			if got.String() != tc.in && tc.in != "" {
				t.Errorf("String() = %q, want %q", got.String(), tc.in)
			}
		})
	}
}

func TestPlace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		cards  []Card
		req    Request
		policy Policy
		want   []int
		err    string // substring of the error
		field  string // RequestError.Field, for invalid requests
	}{
		// Shares of one card.
		{
			name:  "binpack takes the fullest card that fits",
			cards: []Card{card(0, 100, 80000), card(1, 40, 50000), card(2, 60, 50000)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "spread takes the emptiest card",
			cards: []Card{card(0, 40, 50000), card(1, 100, 80000), card(2, 60, 50000)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Spread,
			want: []int{1},
		},
		{
			name:  "binpack skips a card without enough core",
			cards: []Card{card(0, 20, 80000), card(1, 50, 80000), card(2, 100, 80000)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "a card that fits exactly",
			cards: []Card{card(0, 30, 4096), card(1, 100, 80000)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Binpack,
			want: []int{0},
		},
		{
			name:  "memory decides the fit",
			cards: []Card{card(0, 40, 2048), card(1, 100, 80000)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "binpack tie on core: least free memory",
			cards: []Card{card(0, 50, 60000), card(1, 50, 30000), card(2, 50, 40000)},
			req:   Request{Core: 10, MemoryMiB: 1024}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "binpack tie on core and memory: lowest index",
			cards: []Card{card(2, 50, 30000), card(1, 50, 30000), card(3, 50, 30000)},
			req:   Request{Core: 10, MemoryMiB: 1024}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "spread tie on core: most free memory",
			cards: []Card{card(0, 50, 30000), card(1, 50, 60000), card(2, 50, 40000)},
			req:   Request{Core: 10, MemoryMiB: 1024}, policy: Spread,
			want: []int{1},
		},
		{
			name:  "spread tie on core and memory: lowest index",
			cards: []Card{card(3, 100, 80000), card(1, 100, 80000), card(2, 100, 80000)},
			req:   Request{Core: 10, MemoryMiB: 1024}, policy: Spread,
			want: []int{1},
		},
		{
			name:  "a share may go to an entirely free card",
			cards: []Card{card(0, 100, 80000)},
			req:   Request{Core: 99, MemoryMiB: 80000}, policy: Binpack,
			want: []int{0},
		},
		{
			name:  "share: nothing fits",
			cards: []Card{card(0, 20, 70000), card(1, 100, 2048)},
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Binpack,
			err: "no GPU has 30% core and 4096 MiB free (GPU 0: 20% and 70000 MiB free; GPU 1: 100% and 2048 MiB free)",
		},
		{
			name:  "share: no cards",
			cards: nil,
			req:   Request{Core: 30, MemoryMiB: 4096}, policy: Spread,
			err: "no GPU has 30% core and 4096 MiB free (the node has no GPU)",
		},

		// Whole cards.
		{
			name:  "one whole card: lowest free index",
			cards: []Card{card(0, 60, 40000), card(1, 100, 80000), card(2, 100, 80000)},
			req:   Request{Core: 100}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "whole cards do not spread",
			cards: []Card{card(0, 60, 40000), card(1, 100, 80000), card(2, 100, 80000), card(3, 100, 80000)},
			req:   Request{Core: 200}, policy: Spread,
			want: []int{1, 2},
		},
		{
			name:  "whole cards, binpack, input out of order",
			cards: []Card{card(3, 100, 80000), card(2, 100, 80000), card(0, 100, 80000)},
			req:   Request{Core: 200}, policy: Binpack,
			want: []int{0, 2},
		},
		{
			name: "a card with an instance of zero core is not free",
			cards: []Card{
				{Index: 0, MemoryMiB: 80000, MemoryFreeMiB: 79000, CoreFree: 100, Instances: 1},
				card(1, 100, 80000),
			},
			req: Request{Core: 100}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "whole card with memory that fits",
			cards: []Card{card(0, 100, 40000), card(1, 100, 80000)},
			req:   Request{Core: 100, MemoryMiB: 40000}, policy: Binpack,
			want: []int{0},
		},
		{
			name:  "whole card with memory that fits only the second",
			cards: []Card{card(0, 100, 40000), card(1, 100, 80000)},
			req:   Request{Core: 100, MemoryMiB: 60000}, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "whole cards: memory must fit each",
			cards: []Card{card(0, 100, 40000), card(1, 100, 80000)},
			req:   Request{Core: 200, MemoryMiB: 60000}, policy: Binpack,
			err: "fewer than 2 GPUs are entirely free with 60000 MiB (GPU 0: 100% and 40000 MiB free, 0 instances; GPU 1: 100% and 80000 MiB free, 0 instances)",
		},
		{
			name:  "one whole card: none free",
			cards: []Card{card(0, 60, 40000), card(1, 99, 80000)},
			req:   Request{Core: 100}, policy: Spread,
			err: "no GPU is entirely free (GPU 0: 60% and 40000 MiB free, 1 instance; GPU 1: 99% and 80000 MiB free, 1 instance)",
		},
		{
			name:  "more whole cards than the node has",
			cards: []Card{card(0, 100, 80000)},
			req:   Request{Core: 300}, policy: Binpack,
			err: "fewer than 3 GPUs are entirely free (GPU 0: 100% and 80000 MiB free, 0 instances)",
		},

		// Invalid requests.
		{name: "core 0", req: Request{Core: 0, MemoryMiB: 1}, field: "core", err: "invalid request: core 0: must be 1..99"},
		{name: "negative core", req: Request{Core: -5, MemoryMiB: 1}, field: "core", err: "core -5"},
		{name: "core 150", req: Request{Core: 150}, field: "core", err: "invalid request: core 150: above 100 it must be a multiple of 100"},
		{name: "share without memory", req: Request{Core: 30}, field: "memory", err: "invalid request: memory 0 MiB: a share of 30% of one GPU needs a memory quota"},
		{name: "unknown policy", cards: []Card{card(0, 100, 80000)}, req: Request{Core: 30, MemoryMiB: 1}, policy: Policy(7), err: "unknown placement policy(7)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := slices.Clone(tc.cards)
			got, err := Place(tc.cards, tc.req, tc.policy)
			if !slices.Equal(in, tc.cards) {
				t.Errorf("Place changed its input: %v, was %v", tc.cards, in)
			}
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Place = %v, %v; want an error with %q", got, err, tc.err)
				}
				if strings.Contains(err.Error(), "\n") {
					t.Errorf("error of more than one line: %q", err)
				}
				var re *RequestError
				if tc.field != "" && (!errors.As(err, &re) || re.Field != tc.field) {
					t.Errorf("error %v is not a RequestError on field %q", err, tc.field)
				}
				var nf *NoFitError
				if tc.field == "" && tc.policy <= Spread && !errors.As(err, &nf) {
					t.Errorf("error %v is not a NoFitError", err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("Place = %v, %v; want %v", got, err, tc.want)
			}
			// Deterministic: the same input gives the same answer.
			for range 3 {
				again, err := Place(tc.cards, tc.req, tc.policy)
				if err != nil || !slices.Equal(again, got) {
					t.Fatalf("Place again = %v, %v; first %v", again, err, got)
				}
			}
		})
	}
}

func TestPlaceCore(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		cards  []Card
		core   int
		policy Policy
		want   []int
		err    string
	}{
		{
			name:  "binpack: memory is ignored",
			cards: []Card{card(0, 50, 0), card(1, 40, 0), card(2, 100, 0)},
			core:  30, policy: Binpack,
			want: []int{1},
		},
		{
			name:  "spread: memory does not break ties",
			cards: []Card{card(0, 50, 100), card(1, 50, 90000)},
			core:  30, policy: Spread,
			want: []int{0},
		},
		{
			name:  "binpack: memory does not break ties",
			cards: []Card{card(0, 50, 90000), card(1, 50, 100)},
			core:  30, policy: Binpack,
			want: []int{0},
		},
		{
			name:  "whole cards",
			cards: []Card{card(0, 100, 0), card(1, 70, 0), card(2, 100, 0)},
			core:  200, policy: Spread,
			want: []int{0, 2},
		},
		{
			name:  "no fit",
			cards: []Card{card(0, 20, 100), card(1, 10, 100)},
			core:  30, policy: Binpack,
			err: "no GPU has 30% core free (GPU 0: 20% free; GPU 1: 10% free)",
		},
		{
			name:  "no whole card",
			cards: []Card{card(0, 20, 100)},
			core:  100, policy: Binpack,
			err: "no GPU is entirely free (GPU 0: 20% free, 1 instance)",
		},
		{name: "invalid core", core: 250, err: "invalid request: core 250"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := PlaceCore(tc.cards, tc.core, tc.policy)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err && !strings.HasPrefix(err.Error(), tc.err) {
					t.Fatalf("PlaceCore = %v, %v; want error %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("PlaceCore = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}
