package cdi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"gopkg.in/yaml.v3"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/mgpu-dev/mgpu/internal/fsutil"
)

// Spec file formats.
const (
	FormatYAML = "yaml"
	FormatJSON = "json"
)

// SpecFileName is the spec's file name for kind vendor/class and format:
// vendor-class.yaml, the name the CDI library itself would give it.
func SpecFileName(kind, format string) string {
	vendor, class := splitKind(kind)
	return cdiapi.GenerateSpecName(vendor, class) + "." + format
}

func splitKind(kind string) (vendor, class string) {
	vendor, class, _ = strings.Cut(kind, "/")
	return vendor, class
}

const yamlHeader = "# CDI spec of mgpu, written by `mgpu-cli cdi generate`; regenerate it, do not edit.\n"

// Marshal encodes spec as YAML (with a header comment) or indented JSON.
func Marshal(spec *specs.Spec, format string) ([]byte, error) {
	switch format {
	case FormatYAML:
		var b bytes.Buffer
		b.WriteString(yamlHeader)
		enc := yaml.NewEncoder(&b)
		enc.SetIndent(2)
		if err := enc.Encode(spec); err != nil {
			return nil, fmt.Errorf("encode CDI spec: %w", err)
		}
		if err := enc.Close(); err != nil {
			return nil, fmt.Errorf("encode CDI spec: %w", err)
		}
		return b.Bytes(), nil
	case FormatJSON:
		b, err := json.MarshalIndent(spec, "", "  ")
		if err != nil {
			return nil, fmt.Errorf("encode CDI spec: %w", err)
		}
		return append(b, '\n'), nil
	default:
		return nil, fmt.Errorf("unknown spec format %q (want %s or %s)", format, FormatYAML, FormatJSON)
	}
}

// Validate checks encoded spec data the way an engine will: the CDI library
// parses it strictly and validates version, kind, device names and edits.
func Validate(data []byte, format string) error {
	dir, err := os.MkdirTemp("", "mgpu-cdi-validate-")
	if err != nil {
		return fmt.Errorf("validate CDI spec: %w", err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	p := filepath.Join(dir, "spec."+format)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		return fmt.Errorf("validate CDI spec: %w", err)
	}
	if _, err := cdiapi.ReadSpec(p, 0); err != nil {
		return fmt.Errorf("CDI library rejects the spec: %w", err)
	}
	return nil
}

// WriteFile encodes spec in the format its file name says (.json, else
// YAML), validates it, and replaces path atomically with mode 0644.
func WriteFile(path string, spec *specs.Spec) error {
	format := FormatYAML
	if filepath.Ext(path) == ".json" {
		format = FormatJSON
	}
	data, err := Marshal(spec, format)
	if err != nil {
		return err
	}
	if err := Validate(data, format); err != nil {
		return err
	}
	return fsutil.WriteFileAtomic(path, data, 0o644)
}
