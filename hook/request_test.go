package hook

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

func TestResolveRequest(t *testing.T) {
	t.Parallel()
	a := func(kv ...string) map[string]string {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	tests := []struct {
		name    string
		ann     map[string]string
		env     []string
		want    Request
		wantErr string // exact message
		missing bool
	}{
		{
			name: "annotations",
			ann:  a(AnnotationCore, "30", AnnotationMemory, "4096", AnnotationPolicy, "native-burst-share"),
			want: Request{Policy: policy.NativeBurstShare, PolicySet: true, Core: 30, MemoryMiB: 4096,
				PolicyKey: AnnotationPolicy, CoreKey: AnnotationCore, MemoryKey: AnnotationMemory},
		},
		{
			name: "class offline by annotation, env loses",
			ann:  a(AnnotationCore, "30", AnnotationMemory, "4096", AnnotationClass, "offline"),
			env:  []string{"MGPU_CLASS=online"},
			want: Request{Core: 30, MemoryMiB: 4096, Class: policy.Offline, CoreKey: AnnotationCore, MemoryKey: AnnotationMemory, ClassKey: AnnotationClass},
		},
		{
			name: "class online by env",
			env:  []string{"MGPU_CORE=30", "MGPU_MEMORY=1", "MGPU_CLASS=online"},
			want: Request{Core: 30, MemoryMiB: 1, Class: policy.Online, CoreKey: EnvCore, MemoryKey: EnvMemory, ClassKey: EnvClass},
		},
		{
			name:    "bad class",
			env:     []string{"MGPU_CORE=30", "MGPU_MEMORY=1", "MGPU_CLASS=batch"},
			wantErr: `MGPU_CLASS is "batch"; set it to online or offline (or leave it unset for online)`,
		},
		{
			name: "env only, no policy means the device's",
			env:  []string{"PATH=/bin", "MGPU_CORE=100", "MGPU_MEMORY=1"},
			want: Request{Core: 100, MemoryMiB: 1, CoreKey: EnvCore, MemoryKey: EnvMemory},
		},
		{
			name: "annotations win over env, per key",
			ann:  a(AnnotationCore, "30"),
			env:  []string{"MGPU_CORE=50", "MGPU_MEMORY=2048", "MGPU_COMPUTE_POLICY=fixed-share"},
			want: Request{Policy: policy.FixedShare, PolicySet: true, Core: 30, MemoryMiB: 2048,
				PolicyKey: EnvPolicy, CoreKey: AnnotationCore, MemoryKey: EnvMemory},
		},
		{
			name: "an env value that loses is not validated",
			ann:  a(AnnotationCore, "30", AnnotationMemory, "4096"),
			env:  []string{"MGPU_CORE=abc", "MGPU_MEMORY=-1"},
			want: Request{Core: 30, MemoryMiB: 4096, CoreKey: AnnotationCore, MemoryKey: AnnotationMemory},
		},
		{
			name: "the same env key twice with one value",
			env:  []string{"MGPU_CORE=20", "MGPU_MEMORY=10", "MGPU_CORE=20"},
			want: Request{Core: 20, MemoryMiB: 10, CoreKey: EnvCore, MemoryKey: EnvMemory},
		},
		{
			name: "leading zeros are the same number",
			ann:  a(AnnotationCore, "030", AnnotationMemory, "04096"),
			want: Request{Core: 30, MemoryMiB: 4096, CoreKey: AnnotationCore, MemoryKey: AnnotationMemory},
		},
		{
			name: "largest memory",
			ann:  a(AnnotationCore, "1", AnnotationMemory, "16777216"),
			want: Request{Core: 1, MemoryMiB: 16777216, CoreKey: AnnotationCore, MemoryKey: AnnotationMemory},
		},
		{name: "core 101", ann: a(AnnotationCore, "101", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is "101"; set it to a percent from 1 to 100`},
		{name: "core 0", ann: a(AnnotationCore, "0", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is "0"; set it to a percent from 1 to 100`},
		{name: "core negative", env: []string{"MGPU_CORE=-5", "MGPU_MEMORY=1"},
			wantErr: `MGPU_CORE is "-5"; set it to a percent from 1 to 100`},
		{name: "core with percent sign", ann: a(AnnotationCore, "30%", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is "30%"; set it to a percent from 1 to 100`},
		{name: "core fraction", ann: a(AnnotationCore, "0.5", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is "0.5"; set it to a percent from 1 to 100`},
		{name: "core empty", ann: a(AnnotationCore, "", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is ""; set it to a percent from 1 to 100`},
		{name: "core with space", env: []string{"MGPU_CORE= 30", "MGPU_MEMORY=1"},
			wantErr: `MGPU_CORE is " 30"; set it to a percent from 1 to 100`},
		{name: "core huge", ann: a(AnnotationCore, "99999999999999999999999", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-core is "99999999999999999999999"; set it to a percent from 1 to 100`},
		{name: "memory abc", ann: a(AnnotationCore, "10", AnnotationMemory, "abc"),
			wantErr: `vke.volcengine.com/mgpu-memory is "abc"; set it to ` + wantMemory},
		{name: "memory 0", ann: a(AnnotationCore, "10", AnnotationMemory, "0"),
			wantErr: `vke.volcengine.com/mgpu-memory is "0"; set it to ` + wantMemory},
		{name: "memory -1", env: []string{"MGPU_CORE=10", "MGPU_MEMORY=-1"},
			wantErr: `MGPU_MEMORY is "-1"; set it to ` + wantMemory},
		{name: "memory 1.5", ann: a(AnnotationCore, "10", AnnotationMemory, "1.5"),
			wantErr: `vke.volcengine.com/mgpu-memory is "1.5"; set it to ` + wantMemory},
		{name: "memory with unit", ann: a(AnnotationCore, "10", AnnotationMemory, "4096MiB"),
			wantErr: `vke.volcengine.com/mgpu-memory is "4096MiB"; set it to ` + wantMemory},
		{name: "memory in Gi", env: []string{"MGPU_CORE=10", "MGPU_MEMORY=4Gi"},
			wantErr: `MGPU_MEMORY is "4Gi"; set it to ` + wantMemory},
		{name: "memory hex", ann: a(AnnotationCore, "10", AnnotationMemory, "0x1000"),
			wantErr: `vke.volcengine.com/mgpu-memory is "0x1000"; set it to ` + wantMemory},
		{name: "memory over 16 TiB", ann: a(AnnotationCore, "10", AnnotationMemory, "16777217"),
			wantErr: `vke.volcengine.com/mgpu-memory is "16777217"; set it to ` + wantMemory},
		{name: "unknown policy", ann: a(AnnotationPolicy, "burst", AnnotationCore, "10", AnnotationMemory, "1"),
			wantErr: `vke.volcengine.com/mgpu-compute-policy is "burst"; set it to ` + wantPolicy},
		{name: "policy case matters", env: []string{"MGPU_COMPUTE_POLICY=Fixed-Share", "MGPU_CORE=10", "MGPU_MEMORY=1"},
			wantErr: `MGPU_COMPUTE_POLICY is "Fixed-Share"; set it to ` + wantPolicy},
		{name: "env key twice, two values", env: []string{"MGPU_CORE=10", "MGPU_MEMORY=1", "MGPU_CORE=20"},
			wantErr: `MGPU_CORE is set twice ("10" and "20"); set it once`},
		{name: "nothing set", missing: true,
			wantErr: "the container asks for an mgpu device but sets no compute quota: set vke.volcengine.com/mgpu-core (or MGPU_CORE) to " + wantCore +
				" and no memory quota: set vke.volcengine.com/mgpu-memory (or MGPU_MEMORY) to " + wantMemory},
		{name: "memory missing", ann: a(AnnotationCore, "10"), missing: true,
			wantErr: "the container asks for an mgpu device but sets no memory quota: set vke.volcengine.com/mgpu-memory (or MGPU_MEMORY) to " + wantMemory},
		{name: "core missing", env: []string{"MGPU_MEMORY=10", "MGPU_CORES=10"}, missing: true,
			wantErr: "the container asks for an mgpu device but sets no compute quota: set vke.volcengine.com/mgpu-core (or MGPU_CORE) to " + wantCore},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ResolveRequest(tt.ann, tt.env)
			if tt.wantErr != "" {
				if err == nil {
					t.Fatalf("got %+v, want error %q", got, tt.wantErr)
				}
				if err.Error() != tt.wantErr {
					t.Fatalf("error\n got %q\nwant %q", err, tt.wantErr)
				}
				var me *MissingError
				if errors.As(err, &me) != tt.missing {
					t.Fatalf("MissingError = %v, want %v", !tt.missing, tt.missing)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Fatalf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestLookupEnv(t *testing.T) {
	t.Parallel()
	env := []string{"A=1", "B", "C=", "D=x=y", "A=1"}
	for _, tt := range []struct {
		key, val string
		found    bool
	}{{"A", "1", true}, {"B", "", false}, {"C", "", true}, {"D", "x=y", true}, {"E", "", false}} {
		v, found, err := LookupEnv(env, tt.key)
		if err != nil || v != tt.val || found != tt.found {
			t.Errorf("LookupEnv(%q) = %q, %v, %v; want %q, %v", tt.key, v, found, err, tt.val, tt.found)
		}
	}
}

// FuzzResolveRequest checks, for any annotation and env values, that
// resolution never panics, that what it accepts is in range and is exactly
// what the winning value says, and that what it refuses names the key and
// the value.
func FuzzResolveRequest(f *testing.F) {
	f.Add("30", "4096", "fixed-share", "50", "1024", "", true, true)
	f.Add("101", "0", "x", "-1", "1.5", "native-burst-share", false, true)
	f.Add("", "4096MiB", "", "100", "16777216", "guaranteed-burst-share", false, false)
	f.Fuzz(func(t *testing.T, annCore, annMem, annPol, envCore, envMem, envPol string, useAnnCore, useAnnMem bool) {
		ann := map[string]string{AnnotationPolicy: annPol}
		if annPol == "" {
			delete(ann, AnnotationPolicy)
		}
		if useAnnCore {
			ann[AnnotationCore] = annCore
		}
		if useAnnMem {
			ann[AnnotationMemory] = annMem
		}
		env := []string{EnvCore + "=" + envCore, EnvMemory + "=" + envMem}
		if envPol != "" {
			env = append(env, EnvPolicy+"="+envPol)
		}
		coreVal, memVal := envCore, envMem
		if useAnnCore {
			coreVal = annCore
		}
		if useAnnMem {
			memVal = annMem
		}
		r, err := ResolveRequest(ann, env)
		if err != nil {
			var ve *ValueError
			if !errors.As(err, &ve) {
				t.Fatalf("unexpected error type %T: %v", err, err)
			}
			if !strings.HasPrefix(err.Error(), ve.Key+" is "+strconv.Quote(ve.Value)+"; set it to ") {
				t.Fatalf("message %q does not name key and value", err)
			}
			return
		}
		if r.Core < MinCore || r.Core > MaxCore || r.MemoryMiB < 1 || r.MemoryMiB > MaxMemoryMiB {
			t.Fatalf("accepted out of range: %+v", r)
		}
		wantCore, cerr := strconv.ParseUint(coreVal, 10, 64)
		wantMem, merr := strconv.ParseUint(memVal, 10, 64)
		if cerr != nil || merr != nil || uint64(r.Core) != wantCore || r.MemoryMiB != wantMem {
			t.Fatalf("accepted core %q memory %q as %+v", coreVal, memVal, r)
		}
		for _, s := range []string{coreVal, memVal} {
			for _, c := range s {
				if c < '0' || c > '9' {
					t.Fatalf("accepted non-digit value %q", s)
				}
			}
		}
		if r.PolicySet && !r.Policy.Valid() {
			t.Fatalf("invalid policy accepted: %+v", r)
		}
	})
}
