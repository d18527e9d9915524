package logging

import (
	"bytes"
	"strings"
	"testing"
)

func TestNew(t *testing.T) {
	var b bytes.Buffer
	log, err := New(&b, "warn", "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown", "k", 1)
	if s := b.String(); strings.Contains(s, "hidden") || !strings.Contains(s, `"msg":"shown"`) {
		t.Fatalf("log %q: want only the warning, as JSON", s)
	}
	for _, c := range []struct{ level, format, want string }{
		{"loud", "text", `bad --log-level "loud" (want debug, info, warn or error)`},
		{"info", "xml", `bad --log-format "xml" (want text or json)`},
	} {
		if _, err := New(&b, c.level, c.format); err == nil || err.Error() != c.want {
			t.Errorf("New(%q, %q): %v, want %q", c.level, c.format, err, c.want)
		}
	}
}
