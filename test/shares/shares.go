// Package shares holds the tolerance the share tests (test/process,
// test/e2e) assert with.
//
// The normative tolerance is ε = 2 percentage points (DESIGN.md, "Compute
// policies"), and it is what the tests assert, in CI too. MGPU_STRICT_SHARES=0
// asks for the wider Regression tolerance instead, for a machine too loaded
// to time a 10 s window well (a developer's laptop running other work); the
// tests always log what they measured.
package shares

import (
	"os"
	"strconv"
	"time"
)

// Normative is ε, in percentage points.
const Normative = 2.0

// Regression is the tolerance with MGPU_STRICT_SHARES=0, in points: narrow
// enough to catch a broken policy.
const Regression = 5.0

// Strict reports whether the normative tolerance applies (unless
// MGPU_STRICT_SHARES=0).
func Strict() bool { return os.Getenv("MGPU_STRICT_SHARES") != "0" }

// Tolerance is the tolerance to assert with.
func Tolerance() float64 {
	if Strict() {
		return Normative
	}
	return Regression
}

// Window is how long shares are measured: MGPU_SHARE_WINDOW seconds,
// default 10 as the normative semantics say ("any 10 s window").
func Window() time.Duration {
	if s := os.Getenv("MGPU_SHARE_WINDOW"); s != "" {
		if v, err := strconv.ParseFloat(s, 64); err == nil && v > 0 {
			return time.Duration(v * float64(time.Second))
		}
	}
	return 10 * time.Second
}
