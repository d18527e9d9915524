package placement

import (
	"errors"
	"slices"
	"testing"
)

// Two pairs of GPUs, each pair on one PCIe switch (rank 1), the pairs on
// different NUMA nodes (rank 5).
func pairsDist(a, b int) int {
	switch {
	case a == b:
		return 0
	case a/2 == b/2:
		return 1
	}
	return 5
}

func TestPlaceNear(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		free, must []int
		k          int
		want       []int
	}{
		{"a pair on one switch", []int{0, 1, 2, 3}, nil, 2, []int{0, 1}},
		{"the other pair when GPU 0 is taken", []int{1, 2, 3}, nil, 2, []int{2, 3}},
		{"a must-include GPU", []int{1, 2, 3}, []int{3}, 2, []int{2, 3}},
		{"a must-include GPU without its neighbour", []int{2, 3}, []int{1}, 2, []int{1, 2}},
		{"three: ties go to the lowest indexes", []int{0, 1, 2, 3}, nil, 3, []int{0, 1, 2}},
		{"one", []int{3, 2}, nil, 1, []int{2}},
	} {
		got, err := PlaceNear(tc.free, tc.must, tc.k, pairsDist)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v %v, want %v", tc.name, got, err, tc.want)
		}
	}
	var nf *NoFitError
	if _, err := PlaceNear([]int{0, 1}, nil, 3, pairsDist); !errors.As(err, &nf) {
		t.Errorf("3 of 2: %v", err)
	}
	var re *RequestError
	if _, err := PlaceNear([]int{0, 1}, []int{0, 1}, 1, pairsDist); !errors.As(err, &re) {
		t.Errorf("2 must-include for 1: %v", err)
	}
	if _, err := PlaceNear([]int{0, 1}, nil, 0, pairsDist); !errors.As(err, &re) {
		t.Errorf("0 GPUs: %v", err)
	}
}

// Past the exhaustive search the choice is greedy: still k distinct GPUs,
// the must-include ones among them, the same every time, and pairs kept.
func TestPlaceNearGreedy(t *testing.T) {
	t.Parallel()
	var free []int
	for g := 0; g < 40; g++ {
		free = append(free, g)
	}
	got, err := PlaceNear(free, []int{7}, 20, pairsDist)
	if err != nil || len(got) != 20 || !slices.Contains(got, 7) || !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != 20 {
		t.Fatalf("%v %v", got, err)
	}
	if !slices.Contains(got, 6) {
		t.Errorf("GPU 7's switch neighbour 6 was left out: %v", got)
	}
	again, _ := PlaceNear(free, []int{7}, 20, pairsDist)
	if !slices.Equal(got, again) {
		t.Errorf("not deterministic: %v then %v", got, again)
	}
}
