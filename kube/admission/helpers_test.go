package admission

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// applyPatch applies JSON Patch operations to doc as RFC 6902 says, for
// the operation the webhook uses ("add"): the parent of the target must
// exist; an object member is added or replaced; "-" appends to an array,
// an index inserts.
func applyPatch(t *testing.T, doc []byte, ops []PatchOperation) []byte {
	t.Helper()
	var v any
	if err := json.Unmarshal(doc, &v); err != nil {
		t.Fatal(err)
	}
	for _, op := range ops {
		if op.Op != "add" {
			t.Fatalf("operation %q, want add", op.Op)
		}
		if !strings.HasPrefix(op.Path, "/") {
			t.Fatalf("path %q is not a JSON pointer", op.Path)
		}
		b, err := json.Marshal(op.Value)
		if err != nil {
			t.Fatal(err)
		}
		var val any
		if err := json.Unmarshal(b, &val); err != nil {
			t.Fatal(err)
		}
		var tokens []string
		for _, s := range strings.Split(op.Path[1:], "/") {
			tokens = append(tokens, strings.ReplaceAll(strings.ReplaceAll(s, "~1", "/"), "~0", "~"))
		}
		v = add(t, v, tokens, val, op.Path)
	}
	out, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func add(t *testing.T, doc any, path []string, val any, full string) any {
	t.Helper()
	switch d := doc.(type) {
	case map[string]any:
		if len(path) == 1 {
			d[path[0]] = val
			return d
		}
		child, ok := d[path[0]]
		if !ok {
			t.Fatalf("%s: no member %q", full, path[0])
		}
		d[path[0]] = add(t, child, path[1:], val, full)
		return d
	case []any:
		if len(path) == 1 && path[0] == "-" {
			return append(d, val)
		}
		i, err := strconv.Atoi(path[0])
		if err != nil || i < 0 || i > len(d) || (i == len(d) && len(path) > 1) {
			t.Fatalf("%s: bad index %q of an array of %d", full, path[0], len(d))
		}
		if len(path) == 1 {
			return append(d[:i], append([]any{val}, d[i:]...)...)
		}
		d[i] = add(t, d[i], path[1:], val, full)
		return d
	}
	t.Fatalf("%s: %q is in a %T, not an object or array", full, path[0], doc)
	return nil
}

// mergeJSON merges the objects of patch into those of base.
func mergeJSON(t *testing.T, base, patch string) []byte {
	t.Helper()
	var b, p map[string]any
	if err := json.Unmarshal([]byte(base), &b); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(patch), &p); err != nil {
		t.Fatal(err)
	}
	var merge func(b, p map[string]any)
	merge = func(b, p map[string]any) {
		for k, v := range p {
			bm, ok1 := b[k].(map[string]any)
			pm, ok2 := v.(map[string]any)
			if ok1 && ok2 {
				merge(bm, pm)
				continue
			}
			b[k] = v
		}
	}
	merge(b, p)
	out, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestApplyPatch(t *testing.T) {
	t.Parallel()
	got := applyPatch(t, []byte(`{"a":{"b~/c":[1,3]}}`), []PatchOperation{
		{Op: "add", Path: "/a/b~0~1c/1", Value: 2},
		{Op: "add", Path: "/a/b~0~1c/-", Value: 4},
		{Op: "add", Path: "/a/d", Value: map[string]int{"e": 5}},
	})
	if want := `{"a":{"b~/c":[1,2,3,4],"d":{"e":5}}}`; string(got) != want {
		t.Errorf("got %s, want %s", got, want)
	}
}

// logBuffer is a log destination the test reads while servers write.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func testLogger() (*slog.Logger, *logBuffer) {
	b := &logBuffer{}
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug})), b
}
