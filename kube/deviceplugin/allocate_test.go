package deviceplugin

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/kube/placement"
)

// span returns the IDs of GPU gpu with k in [from, to).
func span(gpu, from, to int) []string {
	var out []string
	for k := from; k < to; k++ {
		out = append(out, ID{GPU: gpu, K: k}.String())
	}
	return out
}

func cat(lists ...[]string) []string { return slices.Concat(lists...) }

func newPlugin(t *testing.T, gpus []int, opts ...Option) *Plugin {
	t.Helper()
	uuids := map[int]string{}
	for _, g := range gpus {
		uuids[g] = fmt.Sprintf("GPU-%d", g)
	}
	p, err := New(gpus, newFakeCards(gpus...), append([]Option{WithLogger(testLogger()), WithUUIDs(uuids)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestParseID(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"mgpu-0-00", "mgpu-0-99", "mgpu-12-07"} {
		id, err := ParseID(s)
		if err != nil || id.String() != s {
			t.Errorf("ParseID(%q) = %v, %v", s, id, err)
		}
	}
	for _, s := range []string{"", "mgpu-0-7", "mgpu-0-100", "mgpu-00-07", "mgpu--1-07", "mgpu-+1-07", "gpu-0-07", "mgpu-0-07x", "mgpu-0", "mgpu-a-01", "mgpu-0- 1"} {
		if id, err := ParseID(s); err == nil {
			t.Errorf("ParseID(%q) = %v, want an error", s, id)
		} else if !strings.Contains(err.Error(), "mgpu-<gpu>-<00..99>") {
			t.Errorf("ParseID(%q): %v", s, err)
		}
	}
}

func FuzzParseID(f *testing.F) {
	for _, s := range []string{"mgpu-0-00", "mgpu-3-42", "mgpu-0-100", "mgpu--1-00", "mgpu-1-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := ParseID(s)
		if err != nil {
			return
		}
		if id.String() != s || id.GPU < 0 || id.K < 0 || id.K >= IDsPerGPU {
			t.Fatalf("ParseID(%q) = %+v", s, id)
		}
	})
}

// The node of the preferred-allocation tests: GPU 0 has 40 IDs left, GPU 1
// 70, GPUs 2 and 3 are free.
var partlyUsed = cat(span(0, 60, 100), span(1, 0, 20), span(1, 50, 100), span(2, 0, 100), span(3, 0, 100))

func TestGetPreferredAllocation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		policy    placement.Policy
		available []string
		must      []string
		size      int
		want      []string
		code      codes.Code
		err       string
	}{
		{
			name: "binpack: the fullest GPU that fits", policy: placement.Binpack,
			available: partlyUsed, size: 30,
			want: span(0, 60, 90),
		},
		{
			name: "binpack: GPU 0 is too full for 50", policy: placement.Binpack,
			available: partlyUsed, size: 50,
			want: cat(span(1, 0, 20), span(1, 50, 80)),
		},
		{
			name: "spread: the emptiest GPU", policy: placement.Spread,
			available: partlyUsed, size: 30,
			want: span(2, 0, 30),
		},
		{
			name: "spread: ties go to the lowest index", policy: placement.Spread,
			available: cat(span(3, 0, 100), span(2, 0, 100)), size: 10,
			want: span(2, 0, 10),
		},
		{
			name: "the order of the available IDs does not matter", policy: placement.Binpack,
			available: cat(span(1, 50, 100), span(0, 80, 100), span(0, 60, 80)), size: 30,
			want: span(0, 60, 90),
		},
		{
			name: "a whole GPU", policy: placement.Spread,
			available: partlyUsed, size: 100,
			want: span(2, 0, 100),
		},
		{
			name: "two whole GPUs", policy: placement.Binpack,
			available: partlyUsed, size: 200,
			want: cat(span(2, 0, 100), span(3, 0, 100)),
		},
		{
			name: "must-include picks the GPU", policy: placement.Binpack,
			available: partlyUsed, must: []string{"mgpu-1-95"}, size: 30,
			want: cat(span(1, 0, 20), span(1, 50, 59), []string{"mgpu-1-95"}),
		},
		{
			name: "must-include IDs are kept even when not listed available", policy: placement.Binpack,
			available: span(2, 10, 100), must: []string{"mgpu-2-03", "mgpu-2-05"}, size: 4,
			want: []string{"mgpu-2-03", "mgpu-2-05", "mgpu-2-10", "mgpu-2-11"},
		},
		{
			name: "must-include of a whole GPU", policy: placement.Binpack,
			available: partlyUsed, must: []string{"mgpu-3-05"}, size: 100,
			want: span(3, 0, 100),
		},
		{
			name: "must-include of one of two whole GPUs", policy: placement.Binpack,
			available: cat(span(1, 20, 50), partlyUsed), must: []string{"mgpu-3-05"}, size: 200,
			want: cat(span(1, 0, 100), span(3, 0, 100)),
		},
		{
			name: "nothing fits", policy: placement.Binpack,
			available: cat(span(0, 60, 100), span(1, 50, 100)), size: 60,
			code: codes.ResourceExhausted, err: "mgpu-core: no GPU has 60% core free (GPU 0: 40% free; GPU 1: 50% free)",
		},
		{
			name: "not enough whole GPUs", policy: placement.Binpack,
			available: partlyUsed, size: 300,
			code: codes.ResourceExhausted, err: "mgpu-core: fewer than 3 GPUs are entirely free",
		},
		{
			name: "must-include of two GPUs for a share", policy: placement.Binpack,
			available: partlyUsed, must: []string{"mgpu-1-95", "mgpu-2-00"}, size: 30,
			code: codes.InvalidArgument, err: "mgpu-core: a request under 100 must come from one GPU; must-include IDs are of GPUs 1 and 2",
		},
		{
			name: "must-include of a GPU too full", policy: placement.Binpack,
			available: partlyUsed, must: []string{"mgpu-0-60"}, size: 50,
			code: codes.InvalidArgument, err: "GPU 0 has 40 IDs available, 50 asked for",
		},
		{
			name: "must-include of a GPU not whole", policy: placement.Binpack,
			available: partlyUsed, must: []string{"mgpu-0-60"}, size: 100,
			code: codes.InvalidArgument, err: "GPU 0, which has only 40 of 100 IDs available",
		},
		{
			name: "more must-include than the size", policy: placement.Binpack,
			available: partlyUsed, must: span(2, 0, 3), size: 2,
			code: codes.InvalidArgument, err: "3 must-include IDs for an allocation of 2",
		},
		{
			name: "size not whole GPUs", policy: placement.Binpack,
			available: partlyUsed, size: 150,
			code: codes.InvalidArgument, err: "150 IDs: above 100 a request must be a multiple of 100",
		},
		{
			name: "zero size", policy: placement.Binpack,
			available: partlyUsed, size: 0,
			code: codes.InvalidArgument, err: "mgpu-core: allocation size 0: must be at least 1",
		},
		{
			name: "a malformed ID", policy: placement.Binpack,
			available: []string{"mgpu-0-00", "nvidia0"}, size: 1,
			code: codes.InvalidArgument, err: `mgpu-core: "nvidia0" is not a vke.volcengine.com/mgpu-core device ID`,
		},
		{
			name: "an ID of a GPU the node does not have", policy: placement.Binpack,
			available: []string{"mgpu-7-00"}, size: 1,
			code: codes.InvalidArgument, err: `device ID "mgpu-7-00": the node has no GPU 7`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newPlugin(t, []int{0, 1, 2, 3}, WithPolicy(tc.policy))
			resp, err := p.GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{
				ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
					AvailableDeviceIDs:   tc.available,
					MustIncludeDeviceIDs: tc.must,
					AllocationSize:       int32(tc.size),
				}},
			})
			if tc.err != "" {
				if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.err) {
					t.Fatalf("GetPreferredAllocation = %v, %v; want %v %q", resp, err, tc.code, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.GetContainerResponses()[0].GetDeviceIDs(); !slices.Equal(got, tc.want) {
				t.Fatalf("preferred %v\nwant %v", got, tc.want)
			}
		})
	}
}

func TestGetPreferredAllocationOverGRPC(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	k := startKubelet(t, dir)
	startPlugin(t, dir, []int{0, 1}, newFakeCards(0, 1), WithPolicy(placement.Spread))
	r := k.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	resp, err := r.client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
			{AvailableDeviceIDs: cat(span(0, 50, 100), span(1, 20, 100)), AllocationSize: 25},
			{AvailableDeviceIDs: cat(span(0, 50, 100), span(1, 20, 100)), AllocationSize: 10, MustIncludeDeviceIDs: []string{"mgpu-0-70"}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := resp.GetContainerResponses()
	if len(got) != 2 || !slices.Equal(got[0].GetDeviceIDs(), span(1, 20, 45)) ||
		!slices.Equal(got[1].GetDeviceIDs(), cat(span(0, 50, 59), []string{"mgpu-0-70"})) {
		t.Fatalf("preferred %v", got)
	}
}

func TestAllocate(t *testing.T) {
	t.Parallel()
	type want struct {
		cdi  []string
		core string
	}
	for _, tc := range []struct {
		name string
		ids  []string
		opts []Option
		want want
		err  string
	}{
		{name: "a share", ids: span(1, 10, 40), want: want{cdi: []string{"mgpu.io/gpu=1"}, core: "30"}},
		{name: "one ID", ids: []string{"mgpu-3-99"}, want: want{cdi: []string{"mgpu.io/gpu=3"}, core: "1"}},
		{name: "99 IDs", ids: span(0, 1, 100), want: want{cdi: []string{"mgpu.io/gpu=0"}, core: "99"}},
		{name: "a whole GPU", ids: span(2, 0, 100), want: want{cdi: []string{"mgpu.io/gpu=2"}, core: "100"}},
		{
			name: "two whole GPUs, IDs in any order", ids: cat(span(3, 50, 100), span(0, 0, 100), span(3, 0, 50)),
			want: want{cdi: []string{"mgpu.io/gpu=0", "mgpu.io/gpu=3"}, core: "100"},
		},
		{
			name: "the node's CDI kind", ids: span(1, 0, 5), opts: []Option{WithCDIKind("example.com/gpu")},
			want: want{cdi: []string{"example.com/gpu=1"}, core: "5"},
		},
		{
			name: "a share across GPUs", ids: cat(span(0, 0, 20), span(1, 0, 10)),
			err: "mgpu-core: a request under 100 must come from one GPU; got IDs of GPUs 0 and 1",
		},
		{
			name: "a share across three GPUs", ids: cat(span(2, 0, 1), span(0, 0, 1), span(1, 0, 1)),
			err: "mgpu-core: a request under 100 must come from one GPU; got IDs of GPUs 0, 1 and 2",
		},
		{
			name: "100 IDs of two GPUs", ids: cat(span(0, 0, 50), span(1, 0, 50)),
			err: "mgpu-core: a request of 100 must be whole GPUs (all 100 IDs of each); got 50 IDs of GPU 0 and 50 of GPU 1",
		},
		{
			name: "150 IDs", ids: cat(span(0, 0, 100), span(1, 0, 50)),
			err: "mgpu-core: a request of 150 must be whole GPUs (all 100 IDs of each); got 100 IDs of GPU 0 and 50 of GPU 1",
		},
		{name: "a malformed ID", ids: []string{"mgpu-0-00", "mgpu-0-7"}, err: `mgpu-core: "mgpu-0-7" is not a vke.volcengine.com/mgpu-core device ID (want mgpu-<gpu>-<00..99>)`},
		{name: "an unknown GPU", ids: []string{"mgpu-4-00"}, err: `mgpu-core: device ID "mgpu-4-00": the node has no GPU 4`},
		{name: "a repeated ID", ids: []string{"mgpu-0-01", "mgpu-0-01"}, err: `mgpu-core: device ID "mgpu-0-01" given twice`},
		{name: "no IDs", ids: nil, err: "mgpu-core: no device IDs to allocate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newPlugin(t, []int{0, 1, 2, 3}, tc.opts...)
			req := &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: tc.ids}}}
			resp, err := p.Allocate(context.Background(), req)
			if tc.err != "" {
				if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != tc.err {
					t.Fatalf("Allocate = %v, %v; want %q", resp, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			cr := resp.GetContainerResponses()[0]
			var cdi []string
			for _, d := range cr.GetCdiDevices() {
				cdi = append(cdi, d.GetName())
			}
			if !slices.Equal(cdi, tc.want.cdi) {
				t.Errorf("CDI devices %v, want %v", cdi, tc.want.cdi)
			}
			var host, uuids []string
			for _, c := range tc.want.cdi {
				_, g, _ := strings.Cut(c, "=")
				host = append(host, g)
				uuids = append(uuids, "GPU-"+g)
			}
			want := map[string]string{"MGPU_CORE": tc.want.core, "MGPU_VISIBLE_DEVICES": strings.Join(host, ","), "CUDA_VISIBLE_DEVICES": strings.Join(uuids, ",")}
			if fmt.Sprint(cr.GetEnvs()) != fmt.Sprint(want) {
				t.Errorf("envs %v, want %v", cr.GetEnvs(), want)
			}
			if len(cr.GetMounts()) != 0 || len(cr.GetDevices()) != 0 || len(cr.GetAnnotations()) != 0 {
				t.Errorf("more than CDI devices and environment: %v", cr)
			}
			// Deterministic: the same IDs, in any order, give the same
			// answer.
			for range 3 {
				shuffled := slices.Clone(tc.ids)
				rand.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
				again, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{
					ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: shuffled}},
				})
				if err != nil || !proto.Equal(again, resp) {
					t.Fatalf("Allocate again = %v, %v; first %v", again, err, resp)
				}
			}
		})
	}
}

// TestAllocateReplayed: the kubelet sends the same request twice (it
// replays checkpointed allocations) and gets identical answers, over gRPC,
// even from a plugin that restarted in between and whose GPU went down.
func TestAllocateReplayed(t *testing.T) {
	t.Parallel()
	req := &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: span(1, 0, 40)},
		{DevicesIds: cat(span(0, 0, 100), span(2, 0, 100))},
	}}
	var first *pluginapi.AllocateResponse
	for i, cards := range []*fakeCards{newFakeCards(0, 1, 2), newFakeCards(0, 2)} {
		dir := t.TempDir()
		k := startKubelet(t, dir)
		startPlugin(t, dir, []int{0, 1, 2}, cards)
		r := k.next(t)
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		for range 2 {
			resp, err := r.client.Allocate(ctx, req)
			if err != nil {
				cancel()
				t.Fatal(err)
			}
			if first == nil {
				first = resp
				if len(resp.GetContainerResponses()) != 2 {
					t.Fatalf("Allocate = %v", resp)
				}
			} else if !proto.Equal(resp, first) {
				t.Errorf("plugin %d: Allocate = %v, first %v", i, resp, first)
			}
		}
		cancel()
	}
	if e := first.GetContainerResponses()[1]; len(e.GetCdiDevices()) != 2 || e.GetCdiDevices()[1].GetName() != "mgpu.io/gpu=2" {
		t.Errorf("whole GPUs: %v", e)
	}
}
