package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
)

// DockerConfig is Docker's daemon configuration.
const DockerConfig = "/etc/docker/daemon.json"

// Docker plans the daemon.json that enables CDI (Docker 25+:
// "features": {"cdi": true}) with specDirs as "cdi-spec-dirs". Every other
// key, and the order of keys, is kept; directories already listed stay.
func Docker(path string, specDirs []string) (Plan, error) {
	if path == "" {
		path = DockerConfig
	}
	if len(specDirs) == 0 {
		return nil, errors.New("no CDI spec directories")
	}
	old, mode, err := readFile(path)
	if err != nil {
		return nil, err
	}
	var doc object
	if len(bytes.TrimSpace(old)) > 0 {
		if doc, err = parseObject(old); err != nil {
			return nil, fmt.Errorf("%s: %w (nothing changed)", path, err)
		}
	}

	features := object{}
	if raw, ok := doc.get("features"); ok {
		if features, err = parseObject(raw); err != nil {
			return nil, fmt.Errorf(`%s: "features" must be an object: %w (nothing changed)`, path, err)
		}
	}
	features.set("cdi", json.RawMessage("true"))
	doc.set("features", features.marshal())

	var dirs []string
	if raw, ok := doc.get("cdi-spec-dirs"); ok {
		if err := json.Unmarshal(raw, &dirs); err != nil {
			return nil, fmt.Errorf(`%s: "cdi-spec-dirs" must be a list of directories (nothing changed)`, path)
		}
	}
	for _, d := range specDirs {
		if !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	rawDirs, _ := json.Marshal(dirs) // strings always encode
	doc.set("cdi-spec-dirs", rawDirs)

	var out bytes.Buffer
	if err := json.Indent(&out, doc.marshal(), "", "  "); err != nil {
		return nil, fmt.Errorf("encode %s: %w", path, err)
	}
	out.WriteByte('\n')
	newData := out.Bytes()
	// Unchanged in meaning: keep the file byte for byte.
	if old != nil && sameJSON(old, newData) {
		newData = old
	}
	return Plan{{Path: path, Old: old, New: newData, Mode: mode, Why: "features.cdi and cdi-spec-dirs"}}, nil
}

// object is a JSON object that keeps its keys' order.
type object []member

type member struct {
	key string
	val json.RawMessage
}

func (o object) get(k string) (json.RawMessage, bool) {
	for _, m := range o {
		if m.key == k {
			return m.val, true
		}
	}
	return nil, false
}

func (o *object) set(k string, v json.RawMessage) {
	for i, m := range *o {
		if m.key == k {
			(*o)[i].val = v
			return
		}
	}
	*o = append(*o, member{k, v})
}

func (o object) marshal() json.RawMessage {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(m.key)
		b.Write(k)
		b.WriteByte(':')
		b.Write(m.val)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// parseObject decodes a JSON object, keeping key order and each value's
// text. Errors name the line.
func parseObject(data []byte) (object, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	syntax := func(err error) error {
		// The decoder's offsets count from the value it was at; the
		// whole document's decode gives the offset in the file.
		var whole any
		var se *json.SyntaxError
		if errors.As(json.Unmarshal(data, &whole), &se) {
			return fmt.Errorf("line %d: invalid JSON: %s", lineOf(data, se.Offset), se.Error())
		}
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return errors.New("invalid JSON: unexpected end of file")
		}
		return fmt.Errorf("invalid JSON: %w", err)
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, syntax(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, fmt.Errorf("line %d: want a JSON object", lineOf(data, dec.InputOffset()))
	}
	var o object
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, syntax(err)
		}
		k, ok := tok.(string)
		if !ok {
			return nil, fmt.Errorf("line %d: invalid JSON: want a key", lineOf(data, dec.InputOffset()))
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, syntax(err)
		}
		if _, dup := o.get(k); dup {
			return nil, fmt.Errorf("line %d: duplicate key %q", lineOf(data, dec.InputOffset()), k)
		}
		o = append(o, member{k, v})
	}
	if _, err := dec.Token(); err != nil {
		return nil, syntax(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("line %d: invalid JSON: text after the object", lineOf(data, dec.InputOffset()))
	}
	return o, nil
}

func sameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}
