// Package policy names the three compute policies of a device and converts
// between their names (as written in configs, annotations and env) and the
// numeric codes the seed's `compute_policy` field uses.
package policy

import "fmt"

// Policy is how a device arbitrates GPU time between its instances.
type Policy uint32

const (
	// FixedShare caps every instance at its core even when the GPU is idle.
	FixedShare Policy = 0
	// GuaranteedBurstShare guarantees every instance its core and lends
	// unused time to instances with demand.
	GuaranteedBurstShare Policy = 1
	// NativeBurstShare shares time in proportion to core, with no guarantee.
	NativeBurstShare Policy = 2
)

var names = [...]string{"fixed-share", "guaranteed-burst-share", "native-burst-share"}

// Names lists the valid policy names in code order.
func Names() []string { return append([]string(nil), names[:]...) }

// String returns the policy's name, e.g. "fixed-share".
func (p Policy) String() string {
	if int(p) < len(names) {
		return names[p]
	}
	return fmt.Sprintf("policy(%d)", uint32(p))
}

// Code returns the seed's numeric compute_policy value (0, 1 or 2).
func (p Policy) Code() int { return int(p) }

// Valid reports whether p is one of the three policies.
func (p Policy) Valid() bool { return int(p) < len(names) }

// Parse converts a policy name into a Policy.
func Parse(s string) (Policy, error) {
	for i, n := range names {
		if s == n {
			return Policy(i), nil
		}
	}
	return 0, fmt.Errorf("unknown compute policy %q (want fixed-share, guaranteed-burst-share or native-burst-share)", s)
}

// MarshalText implements encoding.TextMarshaler.
func (p Policy) MarshalText() ([]byte, error) {
	if !p.Valid() {
		return nil, fmt.Errorf("invalid compute policy %d", uint32(p))
	}
	return []byte(p.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (p *Policy) UnmarshalText(b []byte) error {
	v, err := Parse(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// Admission reports whether the policy limits the sum of cores to 100.
func (p Policy) Admission() bool { return p != NativeBurstShare }
