package hook

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
)

func TestParseState(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		in      string
		want    *oci.State
		wantErr string // substring
	}{
		{
			name: "runc createRuntime",
			in:   `{"ociVersion":"1.2.0","id":"ctr-1","status":"creating","pid":4242,"bundle":"/run/b/ctr-1","annotations":{"vke.volcengine.com/mgpu-core":"30"}}`,
			want: &oci.State{Version: "1.2.0", ID: "ctr-1", Status: oci.StateCreating, Pid: 4242, Bundle: "/run/b/ctr-1",
				Annotations: map[string]string{AnnotationCore: "30"}},
		},
		{
			name: "poststop without pid, unknown fields, trailing newline",
			in:   "{\"ociVersion\":\"1.0.2\",\"id\":\"abc.def_1+2\",\"status\":\"stopped\",\"bundle\":\"/b\",\"new\":{}}\n",
			want: &oci.State{Version: "1.0.2", ID: "abc.def_1+2", Status: oci.StateStopped, Bundle: "/b"},
		},
		{name: "empty", in: "", wantErr: "empty input"},
		{name: "blank", in: " \n", wantErr: "empty input"},
		{name: "not json", in: "id=x", wantErr: "invalid JSON"},
		{name: "array", in: `[]`, wantErr: "invalid JSON"},
		{name: "two objects", in: `{"id":"a","bundle":"/b"}{"id":"b"}`, wantErr: "data after the object"},
		{name: "no id", in: `{"pid":1,"bundle":"/b"}`, wantErr: "container id is empty"},
		{name: "bad id", in: `{"id":"a/b","pid":1,"bundle":"/b"}`, wantErr: `container id "a/b" has a character`},
		{name: "dotdot id", in: `{"id":"..","pid":1,"bundle":"/b"}`, wantErr: `container id ".." is not valid`},
		{name: "newline id", in: `{"id":"a\nb","pid":1,"bundle":"/b"}`, wantErr: "has a character"},
		{name: "negative pid", in: `{"id":"a","pid":-1,"bundle":"/b"}`, wantErr: "pid -1 is negative"},
		{name: "relative bundle", in: `{"id":"a","pid":1,"bundle":"b"}`, wantErr: `bundle "b" is not an absolute path`},
		{name: "no bundle", in: `{"id":"a","pid":1}`, wantErr: `bundle "" is not an absolute path`},
		{name: "pid string", in: `{"id":"a","pid":"1","bundle":"/b"}`, wantErr: "invalid JSON"},
		{name: "too large", in: `{"id":"a","bundle":"/b","x":"` + strings.Repeat("x", MaxStateBytes) + `"}`, wantErr: "too large"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseState(strings.NewReader(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestParseStateTooLargeIsErrTooLarge(t *testing.T) {
	t.Parallel()
	_, err := ParseState(bytes.NewReader(make([]byte, MaxStateBytes+1)))
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("got %v, want ErrTooLarge", err)
	}
}

func TestLoadBundle(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, err := LoadBundle(dir); err == nil || !strings.Contains(err.Error(), "read the container's config") {
		t.Fatalf("missing config.json: %v", err)
	}
	spec := oci.Spec{Version: "1.2.0", Process: &oci.Process{Env: []string{"MGPU_CORE=30"}}, Annotations: map[string]string{"a": "b"}}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := LoadBundle(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Process.Env, spec.Process.Env) || got.Annotations["a"] != "b" {
		t.Fatalf("got %+v", got)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"process":`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadBundle(dir); err == nil || !strings.Contains(err.Error(), "config.json: invalid JSON") {
		t.Fatalf("truncated config.json: %v", err)
	}
}

func TestAnnotationsConfigWins(t *testing.T) {
	t.Parallel()
	st := &oci.State{Annotations: map[string]string{"a": "state", "b": "state"}}
	spec := &oci.Spec{Annotations: map[string]string{"a": "config"}}
	got := Annotations(st, spec)
	if got["a"] != "config" || got["b"] != "state" || len(got) != 2 {
		t.Fatalf("got %v", got)
	}
}

// FuzzParseState checks that any input either fails or yields a state that
// satisfies ParseState's promises and survives a round trip.
func FuzzParseState(f *testing.F) {
	f.Add([]byte(`{"ociVersion":"1.2.0","id":"ctr-1","status":"creating","pid":4242,"bundle":"/run/b","annotations":{"k":"v"}}`))
	f.Add([]byte(`{"id":"a","bundle":"/"} `))
	f.Add([]byte(`{"id":"a","bundle":"/b"}{}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"id":"\u0000","pid":1e3,"bundle":"/b"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := ParseState(bytes.NewReader(data))
		if err != nil {
			if st != nil {
				t.Fatal("state returned with an error")
			}
			return
		}
		if ValidateID(st.ID) != nil || st.Pid < 0 || !filepath.IsAbs(st.Bundle) {
			t.Fatalf("accepted invalid state %+v", st)
		}
		b, err := json.Marshal(st)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseState(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("round trip of %s: %v", b, err)
		}
		if len(st.Annotations) == 0 {
			st.Annotations = nil // omitempty drops an empty map
		}
		if !reflect.DeepEqual(st, again) {
			t.Fatalf("round trip changed %+v to %+v", st, again)
		}
	})
}
