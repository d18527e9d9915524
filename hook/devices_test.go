package hook

import (
	"reflect"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/mgpu-dev/mgpu/internal/config"
)

func TestRequestedDevices(t *testing.T) {
	t.Parallel()
	cfg := config.Default()
	cfg.RunDir = "/run/mgpu"
	mount := func(x string) oci.Mount {
		d := "/run/mgpu/gpu" + x + "/client"
		return oci.Mount{Source: d, Destination: d, Type: "bind"}
	}
	tests := []struct {
		name    string
		env     []string
		mounts  []oci.Mount
		want    []Device
		wantErr string
	}{
		{name: "no device", env: []string{"PATH=/bin", "MGPU_CORE=30"}},
		{name: "no process", env: nil},
		{name: "one", env: []string{"MGPU_RUN_DIR=/run/mgpu", "MGPU_DEVICE_0=GPU-a"}, mounts: []oci.Mount{mount("0")},
			want: []Device{{0, "GPU-a"}}},
		{name: "several, sorted, dedup", env: []string{"MGPU_DEVICE_10=GPU-c", "MGPU_DEVICE_2=GPU-b", "MGPU_DEVICE_10=GPU-c"},
			mounts: []oci.Mount{mount("2"), mount("10")}, want: []Device{{2, "GPU-b"}, {10, "GPU-c"}}},
		{name: "run dir with a trailing slash", env: []string{"MGPU_RUN_DIR=/run/mgpu/", "MGPU_DEVICE_1=GPU-a"}, mounts: []oci.Mount{mount("1")},
			want: []Device{{1, "GPU-a"}}},
		{name: "mount without key is not a request", env: []string{"MGPU_DEVICE_1=GPU-b"}, mounts: []oci.Mount{mount("0"), mount("1")},
			want: []Device{{1, "GPU-b"}}},
		{name: "key without mount", env: []string{"MGPU_DEVICE_1=GPU-b"}, mounts: []oci.Mount{mount("0")},
			wantErr: "MGPU_DEVICE_1 is set but /run/mgpu/gpu1/client is not mounted into the container; request GPUs through CDI (--device mgpu.io/gpu=1), not by setting MGPU_DEVICE_1"},
		{name: "mounted elsewhere", env: []string{"MGPU_DEVICE_0=GPU-b"}, mounts: []oci.Mount{{Source: "/run/mgpu/gpu0/client", Destination: "/x"}},
			wantErr: "is not mounted"},
		{name: "other run dir", env: []string{"MGPU_RUN_DIR=/var/run/other", "MGPU_DEVICE_0=GPU-a"}, mounts: []oci.Mount{mount("0")},
			wantErr: `the container's MGPU_RUN_DIR is "/var/run/other" but the node configuration has run_dir = "/run/mgpu"; regenerate the CDI spec`},
		{name: "malformed key", env: []string{"MGPU_DEVICE_x=GPU-a"}, wantErr: "MGPU_DEVICE_x is not a device key of the mgpu CDI spec"},
		{name: "leading zero key", env: []string{"MGPU_DEVICE_01=GPU-a"}, wantErr: "MGPU_DEVICE_01 is not a device key"},
		{name: "bare prefix", env: []string{"MGPU_DEVICE_=GPU-a"}, wantErr: "MGPU_DEVICE_ is not a device key"},
		{name: "empty uuid", env: []string{"MGPU_DEVICE_0="}, wantErr: "MGPU_DEVICE_0 is empty"},
		{name: "two uuids", env: []string{"MGPU_DEVICE_0=GPU-a", "MGPU_DEVICE_0=GPU-b"}, wantErr: `MGPU_DEVICE_0 is set twice ("GPU-a" and "GPU-b")`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			spec := &oci.Spec{Mounts: tt.mounts}
			if tt.env != nil {
				spec.Process = &oci.Process{Env: tt.env}
			}
			got, err := RequestedDevices(cfg, spec)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}
