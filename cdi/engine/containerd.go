package engine

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/BurntSushi/toml"
)

// containerd defaults.
const (
	ContainerdConfig = "/etc/containerd/config.toml"
	ContainerdDropIn = "/etc/containerd/conf.d/mgpu.toml"
)

// containerd versions the drop-in is written for.
const (
	Containerd2  = "2"
	Containerd17 = "1.7"
)

// CRI plugin sections that hold the CDI settings.
const (
	criRuntimePlugin = "io.containerd.cri.v1.runtime" // containerd 2.x, config version 3
	criPlugin17      = "io.containerd.grpc.v1.cri"    // containerd 1.7, config version 2
)

// ContainerdOptions says what to configure.
type ContainerdOptions struct {
	// Config is the main configuration file (ContainerdConfig).
	Config string
	// DropIn is the file written and imported (ContainerdDropIn).
	DropIn string
	// Version is Containerd2 or Containerd17.
	Version string
	// SpecDirs are the CDI spec directories containerd scans.
	SpecDirs []string
}

// Containerd plans a drop-in that makes containerd's CRI plugin read CDI
// specs from SpecDirs, and the import of it in the main configuration.
//
// containerd 2.x (config version 3): CDI is always enabled (containerd
// 2.4 warns that enable_cdi is an unknown key), so the drop-in sets
// cdi_spec_dirs of plugins."io.containerd.cri.v1.runtime". Imported
// plugin sections are merged key by key, so nothing else of the main
// config's CRI settings changes.
//
// containerd 1.7 (config version 2): an imported plugin section replaces
// the main config's section of the same name, so the drop-in carries the
// main config's whole plugins."io.containerd.grpc.v1.cri" section plus
// enable_cdi = true and cdi_spec_dirs. Run the command again after
// editing that section of the main config.
func Containerd(o ContainerdOptions) (Plan, error) {
	if o.Config == "" {
		o.Config = ContainerdConfig
	}
	if o.DropIn == "" {
		o.DropIn = ContainerdDropIn
	}
	if !filepath.IsAbs(o.DropIn) {
		return nil, fmt.Errorf("drop-in path %q must be absolute", o.DropIn)
	}
	if len(o.SpecDirs) == 0 {
		return nil, errors.New("no CDI spec directories")
	}
	minVersion, dropInVersion := int64(2), int64(3)
	switch o.Version {
	case "", Containerd2:
		o.Version = Containerd2
	case Containerd17:
		dropInVersion = 2
	default:
		return nil, fmt.Errorf("unknown containerd version %q (want %s or %s)", o.Version, Containerd2, Containerd17)
	}

	main, mode, err := readFile(o.Config)
	if err != nil {
		return nil, err
	}
	var parsed map[string]any
	if main != nil {
		if _, err := toml.Decode(string(main), &parsed); err != nil {
			return nil, fmt.Errorf("%s: %s (nothing changed)", o.Config, tomlError(err))
		}
		v, _ := parsed["version"].(int64)
		if v < minVersion {
			return nil, fmt.Errorf("%s: config version %d is too old for imports; migrate it first (containerd config migrate)", o.Config, v)
		}
	}

	dropIn, err := containerdDropIn(o, dropInVersion, parsed)
	if err != nil {
		return nil, err
	}
	oldDropIn, dropInMode, err := readFile(o.DropIn)
	if err != nil {
		return nil, err
	}
	plan := Plan{{Path: o.DropIn, Old: oldDropIn, New: dropIn, Mode: dropInMode, Why: "CDI spec directories for containerd's CRI plugin"}}

	newMain := main
	switch {
	case main == nil:
		newMain = fmt.Appendf(nil, "version = %d\nimports = [%q]\n", dropInVersion, o.DropIn)
	case !imported(o.Config, parsed, o.DropIn):
		if newMain, err = addImport(main, o.DropIn); err != nil {
			return nil, fmt.Errorf("%s: %w (nothing changed)", o.Config, err)
		}
		// The edit must leave a document that says the same plus the import.
		var after map[string]any
		if _, err := toml.Decode(string(newMain), &after); err != nil || !imported(o.Config, after, o.DropIn) {
			return nil, fmt.Errorf("%s: could not add the import by a text edit; add %q to imports by hand (nothing changed)", o.Config, o.DropIn)
		}
		delete(after, "imports")
		before := maps(parsed)
		delete(before, "imports")
		if !equalTOML(before, after) {
			return nil, fmt.Errorf("%s: adding the import would change other settings; add %q to imports by hand (nothing changed)", o.Config, o.DropIn)
		}
	}
	plan = append(plan, Change{Path: o.Config, Old: main, New: newMain, Mode: mode, Why: "imports " + o.DropIn})
	return plan, nil
}

func containerdDropIn(o ContainerdOptions, version int64, mainCfg map[string]any) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString("# Written by `mgpu-cli runtime configure --runtime containerd`: makes containerd's\n")
	b.WriteString("# CRI plugin read CDI specs (mgpu's kind mgpu.io/gpu) from these directories.\n")
	if o.Version == Containerd2 {
		b.WriteString("# containerd 2.x always enables CDI (enable_cdi is gone).\n")
		fmt.Fprintf(&b, "version = %d\n\n[plugins.%q]\n  cdi_spec_dirs = %s\n", version, criRuntimePlugin, tomlStrings(o.SpecDirs))
		return b.Bytes(), nil
	}
	// 1.7: the whole CRI section, as imports replace sections.
	b.WriteString("# containerd 1.7 replaces a whole plugin section with an imported one, so this\n")
	fmt.Fprintf(&b, "# carries all of %s's [plugins.%q]; rerun after editing it.\n", o.Config, criPlugin17)
	section := map[string]any{}
	if plugins, ok := mainCfg["plugins"].(map[string]any); ok {
		if cri, ok := plugins[criPlugin17].(map[string]any); ok {
			section = maps(cri) // keep mainCfg as decoded
		}
	}
	section["enable_cdi"] = true
	section["cdi_spec_dirs"] = o.SpecDirs
	doc := map[string]any{"version": version, "plugins": map[string]any{criPlugin17: section}}
	enc := toml.NewEncoder(&b)
	enc.Indent = "  "
	if err := enc.Encode(doc); err != nil {
		return nil, fmt.Errorf("encode containerd drop-in: %w", err)
	}
	return b.Bytes(), nil
}

// imported tells whether the config's imports name path (exactly or by a
// glob; relative entries are relative to the config's directory).
func imported(config string, parsed map[string]any, path string) bool {
	list, _ := parsed["imports"].([]any)
	for _, v := range list {
		s, ok := v.(string)
		if !ok {
			continue
		}
		if !filepath.IsAbs(s) {
			s = filepath.Join(filepath.Dir(config), s)
		}
		if s == path {
			return true
		}
		if ok, _ := filepath.Match(s, path); ok {
			return true
		}
	}
	return false
}

func tomlStrings(list []string) string {
	q := make([]string, len(list))
	for i, s := range list {
		q[i] = fmt.Sprintf("%q", s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

func tomlError(err error) string {
	var pe toml.ParseError
	if errors.As(err, &pe) {
		return fmt.Sprintf("line %d: invalid TOML: %s", pe.Position.Line, pe.Message)
	}
	return "invalid TOML: " + strings.TrimPrefix(err.Error(), "toml: ")
}

func maps(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// equalTOML compares two decoded documents.
func equalTOML(a, b map[string]any) bool {
	if len(a) != len(b) {
		return false
	}
	for k, va := range a {
		vb, ok := b[k]
		if !ok || !equalValue(va, vb) {
			return false
		}
	}
	return true
}

func equalValue(a, b any) bool {
	switch x := a.(type) {
	case map[string]any:
		y, ok := b.(map[string]any)
		return ok && equalTOML(x, y)
	case []map[string]any:
		y, ok := b.([]map[string]any)
		return ok && slices.EqualFunc(x, y, equalTOML)
	case []any:
		y, ok := b.([]any)
		return ok && slices.EqualFunc(x, y, equalValue)
	default:
		return fmt.Sprintf("%T %v", a, a) == fmt.Sprintf("%T %v", b, b)
	}
}
