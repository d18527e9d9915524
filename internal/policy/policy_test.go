package policy

import "testing"

func TestParseAndCodes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		want Policy
		code int
	}{
		{"fixed-share", FixedShare, 0},
		{"guaranteed-burst-share", GuaranteedBurstShare, 1},
		{"native-burst-share", NativeBurstShare, 2},
	} {
		p, err := Parse(tc.name)
		if err != nil || p != tc.want || p.Code() != tc.code || p.String() != tc.name {
			t.Errorf("Parse(%q) = %v (%d), %v", tc.name, p, p.Code(), err)
		}
	}
	for _, bad := range []string{"", "Fixed-Share", "fixed", "burst"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
	if Policy(3).Valid() || !NativeBurstShare.Valid() {
		t.Error("Valid")
	}
	if !FixedShare.Admission() || !GuaranteedBurstShare.Admission() || NativeBurstShare.Admission() {
		t.Error("Admission: only fixed and guaranteed limit the sum of cores")
	}
}

func TestText(t *testing.T) {
	t.Parallel()
	var p Policy
	if err := p.UnmarshalText([]byte("native-burst-share")); err != nil || p != NativeBurstShare {
		t.Fatal(p, err)
	}
	if b, err := p.MarshalText(); err != nil || string(b) != "native-burst-share" {
		t.Fatal(string(b), err)
	}
	if _, err := Policy(9).MarshalText(); err == nil {
		t.Fatal("marshalled an invalid policy")
	}
}
