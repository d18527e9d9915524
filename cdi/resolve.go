package cdi

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

// DefaultSpecDirs are the directories engines read CDI specs from, lowest
// priority first (a device in /var/run/cdi wins over one in /etc/cdi).
var DefaultSpecDirs = []string{"/etc/cdi", "/var/run/cdi"}

// Resolved is one device as the CDI library resolves it.
type Resolved struct {
	// Name is the qualified name, e.g. mgpu.io/gpu=0.
	Name string `json:"name"`
	// Spec is the file the device comes from.
	Spec string `json:"spec"`
	// Edits are the edits requesting this device alone applies: the
	// spec's common edits followed by the device's own.
	Edits specs.ContainerEdits `json:"containerEdits"`
}

// Registry is what the CDI library reads from a set of spec directories.
type Registry struct {
	cache *cdiapi.Cache
	dirs  []string
}

// Open reads the specs in dirs (later directories take precedence).
func Open(dirs ...string) *Registry {
	if len(dirs) == 0 {
		dirs = DefaultSpecDirs
	}
	c, _ := cdiapi.NewCache(cdiapi.WithSpecDirs(dirs...), cdiapi.WithAutoRefresh(false)) // the error is always nil
	return &Registry{cache: c, dirs: dirs}
}

// Errors returns the problems found in spec files, one line per file.
func (r *Registry) Errors() []string {
	var out []string
	for path, errs := range r.cache.GetErrors() {
		out = append(out, fmt.Sprintf("%s: %v", path, strings.ReplaceAll(errors.Join(errs...).Error(), "\n", "; ")))
	}
	sort.Strings(out)
	return out
}

// Devices lists the resolved devices of kind (vendor/class), sorted: GPU
// indices numerically, then UUIDs, then all.
func (r *Registry) Devices(kind string) []Resolved {
	var out []Resolved
	for _, name := range r.cache.ListDevices() {
		if k, _, _ := strings.Cut(name, "="); k != kind {
			continue
		}
		d := r.cache.GetDevice(name)
		if d == nil {
			continue
		}
		edits := specs.ContainerEdits{}
		for _, e := range []specs.ContainerEdits{d.GetSpec().ContainerEdits, d.ContainerEdits} {
			edits.Env = append(edits.Env, e.Env...)
			edits.DeviceNodes = append(edits.DeviceNodes, e.DeviceNodes...)
			edits.Mounts = append(edits.Mounts, e.Mounts...)
			edits.Hooks = append(edits.Hooks, e.Hooks...)
		}
		out = append(out, Resolved{Name: name, Spec: d.GetSpec().GetPath(), Edits: edits})
	}
	sort.SliceStable(out, func(i, j int) bool { return deviceLess(out[i].Name, out[j].Name) })
	return out
}

// Qualify turns a device name into a qualified one: "0" becomes
// kind=0; a qualified name is kept.
func Qualify(kind, name string) string {
	if parser.IsQualifiedName(name) {
		return name
	}
	return kind + "=" + name
}

// Inject applies the named devices (qualified, or short names of kind) to
// ociSpec, as an engine does. An unknown device is an error that names it
// and the devices of kind that exist.
func (r *Registry) Inject(ociSpec *oci.Spec, kind string, names ...string) error {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = Qualify(kind, n)
	}
	for _, n := range q {
		if r.cache.GetDevice(n) == nil {
			return r.unknown(kind, n)
		}
	}
	if _, err := r.cache.InjectDevices(ociSpec, q...); err != nil {
		return fmt.Errorf("inject CDI devices: %w", err)
	}
	return nil
}

// Lookup returns the resolved devices named (qualified, or short names of
// kind), or an error naming the first unknown one.
func (r *Registry) Lookup(kind string, names ...string) ([]Resolved, error) {
	all := r.Devices(kind)
	byName := map[string]Resolved{}
	for _, d := range all {
		byName[d.Name] = d
	}
	var out []Resolved
	for _, n := range names {
		q := Qualify(kind, n)
		d, ok := byName[q]
		if !ok {
			return nil, r.unknown(kind, q)
		}
		out = append(out, d)
	}
	return out, nil
}

func (r *Registry) unknown(kind, name string) error {
	var known []string
	for _, d := range r.Devices(kind) {
		_, short, _ := strings.Cut(d.Name, "=")
		if !strings.HasPrefix(short, "GPU-") {
			known = append(known, short)
		}
	}
	if len(known) == 0 {
		return fmt.Errorf("unknown CDI device %q: no %s devices in %s (run mgpu-cli cdi generate)", name, kind, strings.Join(r.dirs, ", "))
	}
	return fmt.Errorf("unknown CDI device %q (%s has %s, or a GPU-<uuid>)", name, kind, strings.Join(known, ", "))
}

// deviceLess orders kind=0 < kind=2 < kind=10 < kind=GPU-... < kind=all.
func deviceLess(a, b string) bool {
	ra, rb := rank(a), rank(b)
	if ra.class != rb.class {
		return ra.class < rb.class
	}
	if ra.class == 0 && ra.n != rb.n {
		return ra.n < rb.n
	}
	return a < b
}

type deviceRank struct {
	class int // 0 index, 1 uuid or other, 2 all
	n     int
}

func rank(name string) deviceRank {
	_, short, _ := strings.Cut(name, "=")
	if short == AllDevices {
		return deviceRank{class: 2}
	}
	n := 0
	for _, c := range short {
		if c < '0' || c > '9' {
			return deviceRank{class: 1}
		}
		n = n*10 + int(c-'0')
	}
	if short == "" {
		return deviceRank{class: 1}
	}
	return deviceRank{class: 0, n: n}
}
