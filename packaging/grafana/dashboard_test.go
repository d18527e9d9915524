package grafana

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/internal/metrics"
)

const dashboardFile = "mgpu-dashboard.json"

// optionalMetrics are the exported metrics no panel has to show: their
// value is always 1 and their labels are the point.
var optionalMetrics = map[string]bool{
	"mgpu_device_info":   true,
	"mgpu_instance_info": true,
}

// targetLabels are the labels Prometheus adds to every scraped series.
var targetLabels = []string{"instance", "job"}

// The part of Grafana's dashboard JSON model a dashboard import needs and
// the checks read. Types are strict: a number written as a string fails to
// decode.
type dashboard struct {
	Title         string     `json:"title"`
	UID           string     `json:"uid"`
	SchemaVersion *int       `json:"schemaVersion"`
	Version       *int       `json:"version"`
	Templating    templating `json:"templating"`
	Panels        []panel    `json:"panels"`
}

type templating struct {
	List []variable `json:"list"`
}

type variable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	Datasource *datasourceRef  `json:"datasource"`
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID         *int           `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	GridPos    *gridPos       `json:"gridPos"`
	Datasource *datasourceRef `json:"datasource"`
	Targets    []target       `json:"targets"`
	Panels     []panel        `json:"panels"` // a collapsed row's panels
}

type gridPos struct {
	H *int `json:"h"`
	W *int `json:"w"`
	X *int `json:"x"`
	Y *int `json:"y"`
}

type target struct {
	Datasource   *datasourceRef `json:"datasource"`
	Expr         string         `json:"expr"`
	LegendFormat string         `json:"legendFormat"`
	RefID        string         `json:"refId"`
	Format       string         `json:"format"`
}

// panelTypes are the panel plugins Grafana ships that the dashboard may use.
var panelTypes = map[string]bool{
	"row": true, "timeseries": true, "stat": true, "table": true, "bargauge": true,
	"gauge": true, "text": true, "barchart": true, "piechart": true, "heatmap": true,
	"state-timeline": true, "status-history": true,
}

// grafanaVariables are Grafana's built-in variables.
var grafanaVariables = map[string]bool{
	"__rate_interval": true, "__interval": true, "__interval_ms": true,
	"__range": true, "__range_s": true, "__range_ms": true,
	"__from": true, "__to": true, "__dashboard": true,
}

var uidRE = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,40}$`)

// checkDashboard reports every problem of the dashboard raw against the
// exported metrics, or nil.
func checkDashboard(raw []byte, exported []metrics.Metric) error {
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		return fmt.Errorf("decode dashboard: %w", err)
	}
	byName := make(map[string]metrics.Metric, len(exported))
	for _, m := range exported {
		byName[m.Name] = m
	}
	c := &checker{metrics: byName, used: map[string]bool{}}

	if d.Title == "" {
		c.errorf("dashboard: no title")
	}
	if !uidRE.MatchString(d.UID) {
		c.errorf("dashboard: uid %q is not 1-40 letters, digits, '-' or '_'", d.UID)
	}
	if d.SchemaVersion == nil || *d.SchemaVersion < 36 {
		c.errorf("dashboard: schemaVersion missing or below 36 (Grafana 9.4)")
	}
	if d.Version == nil {
		c.errorf("dashboard: no version")
	}
	c.variables(d.Templating.List)
	if len(d.Panels) == 0 {
		c.errorf("dashboard: no panels")
	}
	ids := map[int]string{}
	var top []panel
	for _, p := range d.Panels {
		top = append(top, p)
		c.panel(p, ids)
		for _, q := range p.Panels {
			if p.Type != "row" {
				c.errorf("panel %q: only rows hold panels", p.Title)
			}
			c.panel(q, ids)
		}
	}
	c.overlaps(top)

	for _, m := range exported {
		if !c.used[m.Name] && !optionalMetrics[m.Name] {
			c.errorf("metric %q: no panel uses it", m.Name)
		}
	}
	return errors.Join(c.errs...)
}

type checker struct {
	metrics map[string]metrics.Metric
	vars    map[string]bool
	used    map[string]bool // metrics the panels use
	errs    []error
}

func (c *checker) errorf(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf(format, args...))
}

func (c *checker) variables(list []variable) {
	c.vars = map[string]bool{}
	for _, v := range list {
		if v.Name == "" {
			c.errorf("templating: a variable without a name")
			continue
		}
		if c.vars[v.Name] {
			c.errorf("templating: variable %q twice", v.Name)
		}
		c.vars[v.Name] = true
	}
	i := slices.IndexFunc(list, func(v variable) bool { return v.Name == "datasource" })
	switch {
	case i < 0:
		c.errorf("templating: no variable %q", "datasource")
	case list[i].Type != "datasource":
		c.errorf("templating: variable %q has type %q, want %q", "datasource", list[i].Type, "datasource")
	case string(list[i].Query) != `"prometheus"`:
		c.errorf("templating: variable %q has query %s, want %q", "datasource", list[i].Query, "prometheus")
	}
	for _, v := range list {
		if v.Type != "query" {
			continue
		}
		where := fmt.Sprintf("variable %q", v.Name)
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			c.errorf("%s: datasource uid is not %q", where, "${datasource}")
		}
		c.variableQuery(where, v)
	}
}

var (
	labelValuesRE = regexp.MustCompile(`^\s*label_values\(\s*(?:(.*?)\s*,\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$`)
	queryResultRE = regexp.MustCompile(`^\s*query_result\((.*)\)\s*$`)
)

// variableQuery checks a query variable's label_values(selector, label) or
// query_result(expr).
func (c *checker) variableQuery(where string, v variable) {
	var q string
	if err := json.Unmarshal(v.Query, &q); err != nil {
		var obj struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &obj); err != nil {
			c.errorf("%s: query is neither a string nor an object with a query: %w", where, err)
			return
		}
		q = obj.Query
	}
	if m := labelValuesRE.FindStringSubmatch(q); m != nil {
		if m[1] == "" {
			if !slices.Contains(c.allLabels(), m[2]) {
				c.errorf("%s: no exported metric has label %q", where, m[2])
			}
			return
		}
		e := c.expr(where, m[1])
		if !slices.Contains(e.labels, m[2]) {
			c.errorf("%s: label %q is not a label of %q", where, m[2], e.names)
		}
		return
	}
	if m := queryResultRE.FindStringSubmatch(q); m != nil {
		c.expr(where, m[1])
		return
	}
	c.errorf("%s: query %q is not label_values(...) or query_result(...)", where, q)
}

// allLabels returns every label of every exported metric.
func (c *checker) allLabels() []string {
	out := slices.Clone(targetLabels)
	for _, m := range c.metrics {
		out = append(out, m.Labels...)
	}
	return out
}

func (c *checker) panel(p panel, ids map[int]string) {
	where := fmt.Sprintf("panel %q", p.Title)
	if p.Title == "" {
		c.errorf("panel of type %q: no title", p.Type)
	}
	if p.ID == nil {
		c.errorf("%s: no id", where)
	} else if other, dup := ids[*p.ID]; dup {
		c.errorf("%s: id %d is also panel %q's", where, *p.ID, other)
	} else {
		ids[*p.ID] = p.Title
	}
	if !panelTypes[p.Type] {
		c.errorf("%s: unknown type %q", where, p.Type)
	}
	c.gridPos(where, p.GridPos)
	if p.Type == "row" {
		if len(p.Targets) != 0 {
			c.errorf("%s: a row has no targets", where)
		}
		return
	}
	if p.Datasource != nil && p.Datasource.UID != "${datasource}" {
		c.errorf("%s: datasource uid %q, want %q", where, p.Datasource.UID, "${datasource}")
	}
	if len(p.Targets) == 0 {
		c.errorf("%s: no targets", where)
	}
	refIDs := map[string]bool{}
	for _, t := range p.Targets {
		tw := fmt.Sprintf("%s target %q", where, t.RefID)
		if t.RefID == "" {
			c.errorf("%s: target without refId", where)
		} else if refIDs[t.RefID] {
			c.errorf("%s: refId %q twice", where, t.RefID)
		}
		refIDs[t.RefID] = true
		if t.Datasource == nil || t.Datasource.Type != "prometheus" || t.Datasource.UID != "${datasource}" {
			c.errorf("%s: datasource is not {type: prometheus, uid: %q}", tw, "${datasource}")
		}
		if strings.TrimSpace(t.Expr) == "" {
			c.errorf("%s: no expr", tw)
			continue
		}
		e := c.expr(tw, t.Expr)
		for _, n := range e.names {
			c.used[n] = true
		}
		if t.Format != "table" {
			c.legend(tw, t, e)
		}
	}
}

func (c *checker) gridPos(where string, g *gridPos) {
	if g == nil || g.H == nil || g.W == nil || g.X == nil || g.Y == nil {
		c.errorf("%s: gridPos needs h, w, x and y", where)
		return
	}
	if *g.H < 1 || *g.W < 1 || *g.X < 0 || *g.Y < 0 || *g.X+*g.W > 24 {
		c.errorf("%s: gridPos %+v is off the 24-column grid", where, map[string]int{"h": *g.H, "w": *g.W, "x": *g.X, "y": *g.Y})
	}
}

// overlaps reports top-level panels that cover the same grid cells.
func (c *checker) overlaps(ps []panel) {
	for i, a := range ps {
		for _, b := range ps[i+1:] {
			ga, gb := a.GridPos, b.GridPos
			if ga == nil || gb == nil || ga.H == nil || ga.W == nil || ga.X == nil || ga.Y == nil ||
				gb.H == nil || gb.W == nil || gb.X == nil || gb.Y == nil {
				continue // reported by gridPos
			}
			if *ga.X < *gb.X+*gb.W && *gb.X < *ga.X+*ga.W && *ga.Y < *gb.Y+*gb.H && *gb.Y < *ga.Y+*ga.H {
				c.errorf("panels %q and %q overlap", a.Title, b.Title)
			}
		}
	}
}

var (
	legendLabelRE = regexp.MustCompile(`\{\{\s*([^{}\s]*)\s*\}\}`)
	topAggrRE     = regexp.MustCompile(`^\s*(?i:sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile)\s*(?i:(by|without))\s*\(([^)]*)\)`)
)

// legend checks that a time series' legend names labels its expression's
// series have, and the instance or device they are about.
func (c *checker) legend(where string, t target, e exprInfo) {
	if strings.TrimSpace(t.LegendFormat) == "" {
		c.errorf("%s: no legendFormat", where)
		return
	}
	have := e.labels
	if m := topAggrRE.FindStringSubmatch(t.Expr); m != nil {
		listed := splitLabels(m[2])
		if strings.EqualFold(m[1], "by") {
			have = listed
		} else {
			have = slices.DeleteFunc(slices.Clone(have), func(l string) bool { return slices.Contains(listed, l) })
		}
	}
	var named []string
	for _, m := range legendLabelRE.FindAllStringSubmatch(t.LegendFormat, -1) {
		named = append(named, m[1])
		if !slices.Contains(have, m[1]) {
			c.errorf("%s: legend label %q is not a label of %q", where, m[1], e.names)
		}
	}
	// A series is told from its neighbours by its instance or its device.
	switch {
	case slices.Contains(have, "mgpu_instance"):
		if !slices.Contains(named, "mgpu_instance") {
			c.errorf("%s: legend %q does not name {{mgpu_instance}}", where, t.LegendFormat)
		}
	case slices.Contains(have, "device"):
		if !slices.Contains(named, "device") {
			c.errorf("%s: legend %q does not name {{device}}", where, t.LegendFormat)
		}
	}
}

func splitLabels(s string) []string {
	var out []string
	for l := range strings.SplitSeq(s, ",") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// exprInfo is what a PromQL expression refers to.
type exprInfo struct {
	names  []string // metric names, each once
	labels []string // the labels of those metrics and the target labels
}

var (
	varRE  = regexp.MustCompile(`\$\{([a-zA-Z0-9_]+)(?::[^}]*)?\}|\$([a-zA-Z0-9_]+)|\[\[([a-zA-Z0-9_]+)(?::[^\]]*)?\]\]`)
	mgpuRE = regexp.MustCompile(`mgpu_[a-z_]+`)
)

// expr checks a PromQL expression: its metrics are exported, its label
// matchers and grouping clauses name their labels, its functions exist and
// its Grafana variables are defined.
func (c *checker) expr(where, expr string) exprInfo {
	var e exprInfo
	for _, m := range varRE.FindAllStringSubmatch(expr, -1) {
		name := m[1] + m[2] + m[3]
		if !c.vars[name] && !grafanaVariables[name] {
			c.errorf("%s: variable $%s is not defined", where, name)
		}
	}
	toks, err := lex(expr)
	if err != nil {
		c.errorf("%s: %w", where, err)
		return e
	}
	type labelUse struct{ metric, label string }
	var selectors, grouping []labelUse
	addMetric := func(name string) {
		if _, ok := c.metrics[name]; !ok {
			c.errorf("%s: metric %q is not exported by mgpu", where, name)
			return
		}
		if !slices.Contains(e.names, name) {
			e.names = append(e.names, name)
		}
	}
	for i := 0; i < len(toks); i++ {
		t := toks[i]
		next := token{}
		if i+1 < len(toks) {
			next = toks[i+1]
		}
		switch t.kind {
		case tokPunct:
			switch t.text {
			case "[":
				end, err := closing(toks, i, "[", "]")
				if err != nil {
					c.errorf("%s: %w", where, err)
					return e
				}
				i = end
			case "{": // a selector without a metric name
				ls, end, err := selector(toks, i)
				if err != nil {
					c.errorf("%s: %w", where, err)
					return e
				}
				for _, l := range ls {
					if l.label == "__name__" {
						addMetric(l.value)
					}
					selectors = append(selectors, labelUse{"", l.label})
				}
				i = end
			}
		case tokIdent:
			word := strings.ToLower(t.text)
			switch {
			case groupingKeywords[word]:
				if next.kind != tokPunct || next.text != "(" {
					continue // group_left without labels
				}
				end, err := closing(toks, i+1, "(", ")")
				if err != nil {
					c.errorf("%s: %w", where, err)
					return e
				}
				for _, g := range toks[i+2 : end] {
					switch {
					case g.kind == tokIdent:
						grouping = append(grouping, labelUse{"", g.text})
					case g.kind != tokPunct || g.text != ",":
						c.errorf("%s: %q in %s(...)", where, g.text, t.text)
					}
				}
				i = end
			case keywords[word], aggregations[word]:
			case next.kind == tokPunct && next.text == "(":
				if !functions[word] {
					c.errorf("%s: unknown function %q", where, t.text)
				}
			default:
				addMetric(t.text)
				if next.kind == tokPunct && next.text == "{" {
					ls, end, err := selector(toks, i+1)
					if err != nil {
						c.errorf("%s: %w", where, err)
						return e
					}
					for _, l := range ls {
						selectors = append(selectors, labelUse{t.text, l.label})
					}
					i = end
				}
			}
		}
	}
	e.labels = slices.Clone(targetLabels)
	for _, n := range e.names {
		for _, l := range c.metrics[n].Labels {
			if !slices.Contains(e.labels, l) {
				e.labels = append(e.labels, l)
			}
		}
	}
	for _, u := range selectors {
		if u.label == "__name__" {
			continue
		}
		if m, ok := c.metrics[u.metric]; ok {
			if !slices.Contains(m.Labels, u.label) && !slices.Contains(targetLabels, u.label) {
				c.errorf("%s: metric %q has no label %q", where, u.metric, u.label)
			}
		} else if u.metric == "" && !slices.Contains(e.labels, u.label) {
			c.errorf("%s: label %q is not a label of %q", where, u.label, e.names)
		}
	}
	for _, u := range grouping {
		if !slices.Contains(e.labels, u.label) {
			c.errorf("%s: grouping label %q is not a label of %q", where, u.label, e.names)
		}
	}
	// Every mgpu_ name is one of mgpu's metrics or labels: a check that
	// does not depend on the lexer.
	for _, n := range mgpuRE.FindAllString(expr, -1) {
		if _, ok := c.metrics[n]; !ok && !slices.Contains(c.allLabels(), n) {
			c.errorf("%s: %q is neither a metric nor a label of mgpu", where, n)
		}
	}
	return e
}

var groupingKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

var keywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
	"inf": true, "nan": true, "start": true, "end": true,
}

var aggregations = map[string]bool{
	"sum": true, "avg": true, "min": true, "max": true, "count": true, "group": true,
	"stddev": true, "stdvar": true, "topk": true, "bottomk": true, "quantile": true,
	"count_values": true, "limitk": true, "limit_ratio": true,
}

var functions = func() map[string]bool {
	fs := map[string]bool{}
	for f := range strings.FieldsSeq(`abs absent absent_over_time acos acosh asin asinh atan atanh
		avg_over_time ceil changes clamp clamp_max clamp_min cos cosh count_over_time day_of_month
		day_of_week day_of_year days_in_month deg delta deriv double_exponential_smoothing exp floor
		histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev
		histogram_stdvar histogram_sum holt_winters hour idelta increase irate label_join
		label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute
		month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn
		sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time
		stdvar_over_time sum_over_time tan tanh time timestamp vector year`) {
		fs[f] = true
	}
	return fs
}()

type tokKind int

const (
	tokIdent tokKind = iota + 1
	tokString
	tokNumber
	tokVar
	tokPunct
)

type token struct {
	kind tokKind
	text string // a string's text without its quotes
}

// lex splits a PromQL expression (with Grafana variables) into tokens.
func lex(expr string) ([]token, error) {
	var toks []token
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '$':
			j := i + 1
			if j < len(expr) && expr[j] == '{' {
				k := strings.IndexByte(expr[j:], '}')
				if k < 0 {
					return nil, fmt.Errorf("unterminated ${ at offset %d", i)
				}
				toks = append(toks, token{tokVar, expr[j+1 : j+k]})
				i = j + k + 1
				continue
			}
			k := j
			for k < len(expr) && isIdentChar(expr[k]) {
				k++
			}
			if k == j {
				return nil, fmt.Errorf("lone $ at offset %d", i)
			}
			toks = append(toks, token{tokVar, expr[j:k]})
			i = k
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for j < len(expr) && expr[j] != c {
				if expr[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(expr) {
				return nil, fmt.Errorf("unterminated string at offset %d", i)
			}
			toks = append(toks, token{tokString, expr[i+1 : j]})
			i = j + 1
		case isDigit(c) || c == '.' && i+1 < len(expr) && isDigit(expr[i+1]):
			j := i
			for j < len(expr) && (isIdentChar(expr[j]) || expr[j] == '.') {
				j++
			}
			toks = append(toks, token{tokNumber, expr[i:j]})
			i = j
		case isIdentChar(c) || c == ':':
			j := i
			for j < len(expr) && (isIdentChar(expr[j]) || expr[j] == ':') {
				j++
			}
			toks = append(toks, token{tokIdent, expr[i:j]})
			i = j
		case strings.IndexByte("(){}[],", c) >= 0:
			toks = append(toks, token{tokPunct, expr[i : i+1]})
			i++
		default:
			j := i
			for j < len(expr) && strings.IndexByte("+-*/%^=!<>~@", expr[j]) >= 0 {
				j++
			}
			if j == i {
				return nil, fmt.Errorf("unexpected %q at offset %d", c, i)
			}
			toks = append(toks, token{tokPunct, expr[i:j]})
			i = j
		}
	}
	return toks, nil
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func isIdentChar(c byte) bool {
	return c == '_' || isDigit(c) || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
}

// closing returns the index of the token that closes the one at i.
func closing(toks []token, i int, open, close string) (int, error) {
	depth := 0
	for j := i; j < len(toks); j++ {
		if toks[j].kind != tokPunct {
			continue
		}
		switch toks[j].text {
		case open:
			depth++
		case close:
			depth--
			if depth == 0 {
				return j, nil
			}
		}
	}
	return 0, fmt.Errorf("no %q closes %q", close, open)
}

type matcher struct{ label, op, value string }

// selector parses the label matchers of the selector opened at i and
// returns them and the index of its closing brace.
func selector(toks []token, i int) ([]matcher, int, error) {
	var out []matcher
	j := i + 1
	for j < len(toks) {
		if toks[j].kind == tokPunct && toks[j].text == "}" {
			return out, j, nil
		}
		if j+2 >= len(toks) || toks[j].kind != tokIdent || toks[j+1].kind != tokPunct || toks[j+2].kind != tokString {
			return nil, 0, errors.New("selector: want label, operator, quoted value")
		}
		switch op := toks[j+1].text; op {
		case "=", "!=", "=~", "!~":
			out = append(out, matcher{toks[j].text, op, toks[j+2].text})
		default:
			return nil, 0, fmt.Errorf("selector: operator %q", op)
		}
		j += 3
		if j < len(toks) && toks[j].kind == tokPunct && toks[j].text == "," {
			j++
		}
	}
	return nil, 0, errors.New("selector: no closing brace")
}

func readDashboard(t *testing.T) []byte {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func TestDashboard(t *testing.T) {
	t.Parallel()
	if err := checkDashboard(readDashboard(t), metrics.Metrics()); err != nil {
		t.Errorf("%s:\n%v", dashboardFile, err)
	}
}

// TestCheckerCatchesMistakes breaks a copy of the dashboard in one way at a
// time: the checker must report each.
func TestCheckerCatchesMistakes(t *testing.T) {
	t.Parallel()
	raw := readDashboard(t)
	tests := []struct {
		name   string
		edit   func(d map[string]any)
		errMsg string
	}{
		{
			name: "metric that mgpu does not export",
			edit: func(d map[string]any) {
				replaceExpr(d, "mgpu_instance_gpu_seconds_total", "mgpu_instance_gpu_time_seconds_total")
			},
			errMsg: `metric "mgpu_instance_gpu_time_seconds_total" is not exported by mgpu`,
		},
		{
			name:   "metric misspelt in a label_values variable",
			edit:   func(d map[string]any) { setVariableQuery(d, "device", "label_values(mgpu_devices_up, device)") },
			errMsg: `metric "mgpu_devices_up" is not exported by mgpu`,
		},
		{
			name: "exported metric without a panel",
			edit: func(d map[string]any) {
				removePanels(d, func(p map[string]any) bool { return strings.Contains(exprs(p), "mgpu_instance_launches_total") })
			},
			errMsg: `metric "mgpu_instance_launches_total": no panel uses it`,
		},
		{
			name:   "legend label the metric does not have",
			edit:   func(d map[string]any) { firstTarget(d, "GPU busy")["legendFormat"] = "{{pod}}" },
			errMsg: `legend label "pod" is not a label of`,
		},
		{
			name: "legend label dropped by the aggregation",
			edit: func(d map[string]any) {
				firstTarget(d, "Quota violations in the time range")["legendFormat"] = "{{mgpu_instance}} {{container}}"
			},
			errMsg: `legend label "container" is not a label of`,
		},
		{
			name:   "selector label the metric does not have",
			edit:   func(d map[string]any) { replaceExpr(d, `device=~"$device"`, `gpu=~"$device"`) },
			errMsg: `has no label "gpu"`,
		},
		{
			name:   "grouping label no metric has",
			edit:   func(d map[string]any) { replaceExpr(d, "sum by (instance,", "sum by (node,") },
			errMsg: `grouping label "node"`,
		},
		{
			name:   "undefined variable",
			edit:   func(d map[string]any) { replaceExpr(d, `"$device"`, `"$gpu"`) },
			errMsg: `variable $gpu is not defined`,
		},
		{
			name:   "unknown function",
			edit:   func(d map[string]any) { replaceExpr(d, "rate(mgpu_device_busy", "rat(mgpu_device_busy") },
			errMsg: `unknown function "rat"`,
		},
		{
			name: "target datasource not the variable",
			edit: func(d map[string]any) {
				firstTarget(d, "GPU busy")["datasource"] = map[string]any{"type": "prometheus", "uid": "prom"}
			},
			errMsg: `datasource is not {type: prometheus, uid: "${datasource}"}`,
		},
		{
			name:   "target without refId",
			edit:   func(d map[string]any) { delete(firstTarget(d, "GPU busy"), "refId") },
			errMsg: `target without refId`,
		},
		{
			name:   "target without expr",
			edit:   func(d map[string]any) { firstTarget(d, "GPU busy")["expr"] = "" },
			errMsg: `no expr`,
		},
		{
			name:   "panel without targets",
			edit:   func(d map[string]any) { panelByTitle(d, "GPU busy")["targets"] = []any{} },
			errMsg: `panel "GPU busy": no targets`,
		},
		{
			name:   "duplicate panel id",
			edit:   func(d map[string]any) { panelByTitle(d, "GPU busy")["id"] = panelByTitle(d, "Processes")["id"] },
			errMsg: `is also panel`,
		},
		{
			name:   "panel without gridPos",
			edit:   func(d map[string]any) { delete(panelByTitle(d, "Processes"), "gridPos") },
			errMsg: `panel "Processes": gridPos needs h, w, x and y`,
		},
		{
			name:   "panels overlap",
			edit:   func(d map[string]any) { panelByTitle(d, "Processes")["gridPos"].(map[string]any)["x"] = 0 },
			errMsg: `overlap`,
		},
		{
			name:   "panel without type",
			edit:   func(d map[string]any) { delete(panelByTitle(d, "Processes"), "type") },
			errMsg: `unknown type ""`,
		},
		{
			name:   "schemaVersion not a number",
			edit:   func(d map[string]any) { d["schemaVersion"] = "39" },
			errMsg: `decode dashboard`,
		},
		{
			name:   "no uid",
			edit:   func(d map[string]any) { delete(d, "uid") },
			errMsg: `uid ""`,
		},
		{
			name:   "no panels",
			edit:   func(d map[string]any) { d["panels"] = []any{} },
			errMsg: `dashboard: no panels`,
		},
		{
			name: "no datasource variable",
			edit: func(d map[string]any) {
				tl := d["templating"].(map[string]any)
				tl["list"] = slices.DeleteFunc(tl["list"].([]any), func(v any) bool { return v.(map[string]any)["name"] == "datasource" })
			},
			errMsg: `templating: no variable "datasource"`,
		},
		{
			name: "datasource variable of the wrong type",
			edit: func(d map[string]any) {
				for _, v := range d["templating"].(map[string]any)["list"].([]any) {
					if v := v.(map[string]any); v["name"] == "datasource" {
						v["type"] = "custom"
					}
				}
			},
			errMsg: `has type "custom"`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var d map[string]any
			if err := json.Unmarshal(raw, &d); err != nil {
				t.Fatal(err)
			}
			tt.edit(d)
			broken, err := json.Marshal(d)
			if err != nil {
				t.Fatal(err)
			}
			err = checkDashboard(broken, metrics.Metrics())
			if err == nil {
				t.Fatalf("the checker passed a dashboard with a %s", tt.name)
			}
			if !strings.Contains(err.Error(), tt.errMsg) {
				t.Errorf("error does not mention %q:\n%v", tt.errMsg, err)
			}
			t.Logf("the checker says:\n%v", err)
		})
	}
}

func TestLexSelector(t *testing.T) {
	t.Parallel()
	toks, err := lex(`sum by (device) (rate(mgpu_device_busy_seconds_total{device=~"$device", uuid!="a\"}"}[$__rate_interval] offset 5m)) > 0.5`)
	if err != nil {
		t.Fatal(err)
	}
	var idents []string
	for _, tk := range toks {
		if tk.kind == tokIdent {
			idents = append(idents, tk.text)
		}
	}
	want := []string{"sum", "by", "device", "rate", "mgpu_device_busy_seconds_total", "device", "uuid", "offset"}
	if !slices.Equal(idents, want) {
		t.Errorf("identifiers %q, want %q", idents, want)
	}
	i := slices.IndexFunc(toks, func(tk token) bool { return tk.text == "{" })
	ms, _, err := selector(toks, i)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 2 || ms[0] != (matcher{"device", "=~", "$device"}) || ms[1].label != "uuid" || ms[1].op != "!=" {
		t.Errorf("matchers %+v", ms)
	}
}

// Helpers that edit the decoded dashboard.

func allPanels(d map[string]any) []map[string]any {
	var out []map[string]any
	for _, p := range d["panels"].([]any) {
		p := p.(map[string]any)
		out = append(out, p)
		if inner, ok := p["panels"].([]any); ok {
			for _, q := range inner {
				out = append(out, q.(map[string]any))
			}
		}
	}
	return out
}

func panelByTitle(d map[string]any, title string) map[string]any {
	for _, p := range allPanels(d) {
		if p["title"] == title {
			return p
		}
	}
	panic(fmt.Sprintf("no panel %q", title))
}

func firstTarget(d map[string]any, title string) map[string]any {
	return panelByTitle(d, title)["targets"].([]any)[0].(map[string]any)
}

func exprs(p map[string]any) string {
	var b strings.Builder
	ts, _ := p["targets"].([]any)
	for _, t := range ts {
		e, _ := t.(map[string]any)["expr"].(string)
		b.WriteString(e + "\n")
	}
	return b.String()
}

// replaceExpr replaces from by to in the first expr that has it.
func replaceExpr(d map[string]any, from, to string) {
	for _, p := range allPanels(d) {
		ts, _ := p["targets"].([]any)
		for _, t := range ts {
			t := t.(map[string]any)
			if e, _ := t["expr"].(string); strings.Contains(e, from) {
				t["expr"] = strings.Replace(e, from, to, 1)
				return
			}
		}
	}
	panic(fmt.Sprintf("no expr has %q", from))
}

func removePanels(d map[string]any, drop func(map[string]any) bool) {
	d["panels"] = slices.DeleteFunc(d["panels"].([]any), func(p any) bool { return drop(p.(map[string]any)) })
}

func setVariableQuery(d map[string]any, name, query string) {
	for _, v := range d["templating"].(map[string]any)["list"].([]any) {
		if v := v.(map[string]any); v["name"] == name {
			v["query"], v["definition"] = query, query
			return
		}
	}
	panic(fmt.Sprintf("no variable %q", name))
}
