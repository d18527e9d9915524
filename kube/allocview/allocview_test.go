package allocview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

var t0 = time.Date(2026, 12, 4, 20, 0, 0, 0, time.UTC)

const (
	uuid0 = "GPU-5a1e0000-0000-4000-8000-000000000000"
	uuid1 = "GPU-5a1e0000-0000-4000-8000-000000000001"
)

// seedNode is the seed's binpack node: four 15 GiB GPUs, 15 and 9 GiB
// allocated.
func seedNode() Node {
	return Node{Updated: t0, GPUs: []GPU{
		{Index: 0, UUID: uuid0, AllocatedMiB: 15 << 10, TotalMiB: 15 << 10, Instances: 3, Running: true},
		{Index: 1, UUID: uuid1, AllocatedMiB: 9 << 10, TotalMiB: 15 << 10, Instances: 2, Running: true},
		{Index: 2, TotalMiB: 15 << 10, Running: true},
		{Index: 3, TotalMiB: 15 << 10},
	}}
}

const seedJSON = `{"gpus":[` +
	`{"index":0,"uuid":"GPU-5a1e0000-0000-4000-8000-000000000000","allocated_mib":15360,"total_mib":15360,"instances":3,"running":true},` +
	`{"index":1,"uuid":"GPU-5a1e0000-0000-4000-8000-000000000001","allocated_mib":9216,"total_mib":15360,"instances":2,"running":true},` +
	`{"index":2,"allocated_mib":0,"total_mib":15360,"instances":0,"running":true},` +
	`{"index":3,"allocated_mib":0,"total_mib":15360,"instances":0,"running":false}` +
	`],"updated":"2026-12-04T20:00:00Z"}`

func TestEncode(t *testing.T) {
	t.Parallel()
	n := seedNode()
	// Out of order and in another zone: the same value.
	n.GPUs[0], n.GPUs[3] = n.GPUs[3], n.GPUs[0]
	n.Updated = t0.In(time.FixedZone("CST", 8*3600))
	got, err := Encode(n)
	if err != nil {
		t.Fatal(err)
	}
	if got != seedJSON {
		t.Errorf("got\n%s\nwant\n%s", got, seedJSON)
	}
	if n.GPUs[0].Index != 3 {
		t.Error("Encode reordered the caller's GPUs")
	}
	back, err := Decode(got)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, seedNode()) {
		t.Errorf("decoded %+v, want %+v", back, seedNode())
	}

	// No GPU: an empty list, not null.
	if got, err := Encode(Node{Updated: t0}); err != nil || got != `{"gpus":[],"updated":"2026-12-04T20:00:00Z"}` {
		t.Errorf("no GPU: %s %v", got, err)
	}
	// What Decode refuses is not encoded.
	bad := seedNode()
	bad.GPUs[1].AllocatedMiB = bad.GPUs[1].TotalMiB + 1
	if _, err := Encode(bad); !errors.Is(err, ErrInvalid) {
		t.Errorf("over-allocated: %v", err)
	}
	if _, err := Encode(Node{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("no time: %v", err)
	}
}

func TestDecode(t *testing.T) {
	t.Parallel()
	gpus := func(g ...string) string {
		return `{"gpus":[` + strings.Join(g, ",") + `],"updated":"2026-12-04T20:00:00Z"}`
	}
	gpu := func(fields string) string {
		return `{"index":0,"allocated_mib":0,"total_mib":1024,"instances":0,"running":true` + fields + `}`
	}
	many := make([]string, MaxGPUs+1)
	for i := range many {
		many[i] = fmt.Sprintf(`{"index":%d,"allocated_mib":0,"total_mib":1,"instances":0,"running":true}`, i)
	}
	for _, tc := range []struct {
		name, in, err string // err "": valid
	}{
		{"seed", seedJSON, ""},
		{"whitespace around", " \n" + seedJSON + "\n ", ""},
		{"null gpus", `{"gpus":null,"updated":"2026-12-04T20:00:00Z"}`, ""},
		{"no uuid", gpus(gpu("")), ""},
		{"max GPUs", gpus(many[:MaxGPUs]...), ""},
		{"empty", "", "invalid GPU allocation: EOF"},
		{"not JSON", "mgpu", "invalid GPU allocation: invalid character 'm' looking for beginning of value"},
		{"array", "[]", "invalid GPU allocation: json: cannot unmarshal array into Go value of type allocview.Node"},
		{"null", "null", "invalid GPU allocation: want an object"},
		{"unknown field", `{"gpus":[],"updated":"2026-12-04T20:00:00Z","x":1}`, `invalid GPU allocation: json: unknown field "x"`},
		{"unknown GPU field", gpus(gpu(`,"memory":1`)), `invalid GPU allocation: json: unknown field "memory"`},
		{"other case", `{"GPUs":[],"updated":"2026-12-04T20:00:00Z"}`, `invalid GPU allocation: unknown field "GPUs"`},
		{"other case in a GPU", gpus(`{"Index":0,"allocated_mib":0,"total_mib":1,"instances":0,"running":true}`), `invalid GPU allocation: unknown field "Index"`},
		{"duplicate key", gpus(gpu(`,"allocated_mib":2048`)), `invalid GPU allocation: field "allocated_mib" appears twice`},
		{"duplicate top key", `{"gpus":[],"gpus":[],"updated":"2026-12-04T20:00:00Z"}`, `invalid GPU allocation: field "gpus" appears twice`},
		{"null GPU", gpus("null"), "invalid GPU allocation: want an object"},
		{"trailing object", seedJSON + "{}", "invalid GPU allocation: data after the JSON object"},
		{"trailing garbage", seedJSON + "x", "invalid GPU allocation: data after the JSON object"},
		{"no time", `{"gpus":[]}`, "invalid GPU allocation: no updated time"},
		{"bad time", `{"gpus":[],"updated":"yesterday"}`, `invalid GPU allocation: parsing time "yesterday" as "2006-01-02T15:04:05Z07:00": cannot parse "yesterday" as "2006"`},
		{"time beyond 9999 in UTC", `{"gpus":[],"updated":"9999-12-31T23:59:59-23:59"}`, "invalid GPU allocation: updated time 9999-12-31T23:59:59-23:59 is out of range"},
		{"time before 1970", `{"gpus":[],"updated":"1969-12-31T23:59:59Z"}`, "invalid GPU allocation: updated time 1969-12-31T23:59:59Z is out of range"},
		{"negative MiB", gpus(`{"index":0,"allocated_mib":-1,"total_mib":1,"instances":0,"running":true}`), "invalid GPU allocation: json: cannot unmarshal number -1 into Go struct field GPU.gpus.allocated_mib of type uint64"},
		{"negative index", gpus(`{"index":-1,"allocated_mib":0,"total_mib":1,"instances":0,"running":true}`), "invalid GPU allocation: GPU index -1 is negative"},
		{"duplicate index", gpus(gpu(""), gpu("")), "invalid GPU allocation: GPU 0 appears twice"},
		{"over-allocated", gpus(`{"index":0,"allocated_mib":1025,"total_mib":1024,"instances":1,"running":true}`), "invalid GPU allocation: GPU 0: allocated_mib 1025 is over total_mib 1024"},
		{"huge GPU", gpus(`{"index":0,"allocated_mib":0,"total_mib":4294967297,"instances":0,"running":true}`), "invalid GPU allocation: GPU 0: total_mib 4294967297 is over 4294967296"},
		{"negative instances", gpus(`{"index":0,"allocated_mib":0,"total_mib":1,"instances":-1,"running":true}`), "invalid GPU allocation: GPU 0: instances -1 is negative"},
		{"allocated but not running", gpus(`{"index":0,"allocated_mib":1,"total_mib":1,"instances":1,"running":false}`), "invalid GPU allocation: GPU 0: not running but allocated_mib 1 and instances 1 (want 0)"},
		{"uuid with a newline", gpus(gpu(`,"uuid":"GPU-1\nx"`)), `invalid GPU allocation: GPU 0: uuid "GPU-1\nx" has characters other than printable ones`},
		{"long uuid", gpus(gpu(`,"uuid":"` + strings.Repeat("a", MaxUUIDLen+1) + `"`)), "invalid GPU allocation: GPU 0: uuid of 129 bytes, at most 128"},
		{"too many GPUs", gpus(many...), "invalid GPU allocation: 65 GPUs, at most 64"},
		{"too large", seedJSON + strings.Repeat(" ", MaxSize), fmt.Sprintf("invalid GPU allocation: %d bytes, at most %d", len(seedJSON)+MaxSize, MaxSize)},
		{"long unknown field", `{"` + strings.Repeat("x", 1000) + `":1}`, `invalid GPU allocation: json: unknown field "` + strings.Repeat("x", 160-len(`json: unknown field "`)) + "..."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			n, err := Decode(tc.in)
			if tc.err == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || err.Error() != tc.err || !errors.Is(err, ErrInvalid) {
				t.Errorf("Decode: %v (%+v)\nwant %s", err, n, tc.err)
			}
		})
	}
}

// TestDecodeSorts: GPUs come back by index, and null as an empty list.
func TestDecodeSorts(t *testing.T) {
	t.Parallel()
	n, err := Decode(`{"gpus":[{"index":2,"allocated_mib":0,"total_mib":1,"instances":0,"running":true},` +
		`{"index":0,"allocated_mib":0,"total_mib":1,"instances":0,"running":true}],"updated":"2026-12-04T20:00:00Z"}`)
	if err != nil || len(n.GPUs) != 2 || n.GPUs[0].Index != 0 || n.GPUs[1].Index != 2 {
		t.Errorf("%+v %v", n, err)
	}
	n, err = Decode(`{"gpus":null,"updated":"2026-12-04T20:00:00Z"}`)
	if err != nil || n.GPUs == nil {
		t.Errorf("%#v %v", n, err)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(seedJSON)
	f.Add(`{"gpus":[],"updated":"2026-12-04T20:00:00Z"}`)
	f.Add(`{"gpus":[{"index":0,"Index":1}],"updated":"2026-12-04T20:00:00+08:00"}`)
	f.Add(`{"gpus":[null],"updated":null}`)
	f.Add(`{"gpus":[],"updated":"9999-12-31T23:59:59-23:59"}`)
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Decode(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || strings.ContainsAny(err.Error(), "\n\r") {
				t.Fatalf("error %q", err)
			}
			return
		}
		// What Decode accepts encodes, and decodes back the same.
		e, err := Encode(n)
		if err != nil {
			t.Fatalf("Encode of a decoded node: %v", err)
		}
		back, err := Decode(e)
		if err != nil {
			t.Fatalf("Decode of %s: %v", e, err)
		}
		if !back.Updated.Equal(n.Updated) || !reflect.DeepEqual(back.GPUs, n.GPUs) {
			t.Fatalf("round trip %+v, want %+v", back, n)
		}
	})
}

// fakeSource answers Device from fixed data.
type fakeSource struct {
	resp api.DeviceResponse
	err  error
}

func (f fakeSource) Device(context.Context) (api.DeviceResponse, error) { return f.resp, f.err }

func devices() []device.Info {
	return []device.Info{
		{Index: 0, UUID: uuid0, MemoryBytes: 81920 << 20},
		{Index: 1, UUID: uuid1, MemoryBytes: 23028 << 20},
	}
}

func TestReadNewNode(t *testing.T) {
	t.Parallel()
	down := fmt.Errorf("%w (no one listens)", api.ErrNotRunning)
	rs := Read(context.Background(), devices(), []Source{
		// The enforcer's memory is not the one shown: the device's is.
		fakeSource{resp: api.DeviceResponse{MemoryMiB: 1, MemoryAllocatedMiB: 12192, Instances: 2}},
		fakeSource{resp: api.DeviceResponse{MemoryAllocatedMiB: 5, Instances: 1}, err: down},
	})
	if len(rs) != 2 || rs[0].Err != nil || !errors.Is(rs[1].Err, api.ErrNotRunning) || rs[1].Device.Instances != 0 {
		t.Fatalf("%+v", rs)
	}
	n := NewNode(rs, t0)
	want := Node{Updated: t0, GPUs: []GPU{
		{Index: 0, UUID: uuid0, AllocatedMiB: 12192, TotalMiB: 81920, Instances: 2, Running: true},
		{Index: 1, UUID: uuid1, TotalMiB: 23028},
	}}
	if !reflect.DeepEqual(n, want) {
		t.Errorf("%+v\nwant %+v", n, want)
	}
	if _, err := Encode(n); err != nil {
		t.Error(err)
	}
}

// TestCollect asks a stand-in enforcer on device 0's control socket; none
// listens on device 1's.
func TestCollect(t *testing.T) {
	t.Parallel()
	cfg := &config.Config{RunDir: t.TempDir()}
	if err := os.MkdirAll(cfg.DeviceRunDir(0), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", api.ControlSocket(cfg.DeviceRunDir(0)))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/device" {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(api.DeviceResponse{Index: 0, MemoryMiB: 81920, MemoryAllocatedMiB: 4097, Instances: 1})
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })

	before := time.Now()
	n := Collect(context.Background(), cfg, devices())
	want := []GPU{
		{Index: 0, UUID: uuid0, AllocatedMiB: 4097, TotalMiB: 81920, Instances: 1, Running: true},
		{Index: 1, UUID: uuid1, TotalMiB: 23028},
	}
	if !reflect.DeepEqual(n.GPUs, want) || n.Updated.Before(before) || n.Updated.After(time.Now()) {
		t.Errorf("%+v\nwant GPUs %+v", n, want)
	}
}
