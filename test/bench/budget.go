package main

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
)

// goal is what a figure is held to: at most (or, atLeast, at least) limit,
// or, with no limit, only a note printed beside the figure.
type goal struct {
	limit   float64
	atLeast bool
	has     bool
	note    string // printed after the budget, e.g. what it assumes
}

// atMost is a budget the figure must not exceed.
func atMost(v float64, note string) goal { return goal{limit: v, has: true, note: note} }

// atLeast is a budget the figure must reach.
func atLeast(v float64, note string) goal {
	return goal{limit: v, atLeast: true, has: true, note: note}
}

// info is a figure without a budget.
func info(note string) goal { return goal{note: note} }

func (g goal) String() string {
	s := g.note
	if g.has {
		op := "<="
		if g.atLeast {
			op = ">="
		}
		s = strings.TrimSpace(fmt.Sprintf("%s %g %s", op, g.limit, g.note))
	}
	return s
}

// met reports whether v is within the budget (a NaN never is).
func (g goal) met(v float64) bool {
	if math.IsNaN(v) {
		return false
	}
	if g.atLeast {
		return v >= g.limit
	}
	return v <= g.limit
}

// verdict prints the summary line and returns the names of the figures
// over their budget.
func verdict(w io.Writer, rows []row) []string {
	var over []string
	n := 0
	for _, r := range rows {
		if !r.goal.has {
			continue
		}
		n++
		if !r.goal.met(r.value) {
			over = append(over, r.name)
		}
	}
	sort.Strings(over)
	if len(over) == 0 {
		fmt.Fprintf(w, "\nVERDICT %d of %d figures with a budget are over it\n", 0, n)
		return nil
	}
	fmt.Fprintf(w, "\nVERDICT %d of %d figures with a budget are over it: %s\n", len(over), n, strings.Join(over, ", "))
	return over
}

// paired summarises interleaved rounds of a side-by-side measurement:
// the medians of each side and of the per-round differences (on − off),
// and the spread of the differences (their interquartile range).
type paired struct {
	off, on, diff, spread float64
}

func summarise(off, on []float64) paired {
	d := make([]float64, len(on))
	for i := range on {
		d[i] = on[i] - off[i]
	}
	sort.Float64s(d)
	q := func(p float64) float64 {
		if len(d) == 0 {
			return math.NaN()
		}
		return d[int(math.Round(p*float64(len(d)-1)))]
	}
	return paired{off: median(off), on: median(on), diff: q(0.5), spread: q(0.75) - q(0.25)}
}
