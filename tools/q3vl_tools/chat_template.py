"""The Qwen3-VL Instruct chat template (spec 6.4) as Jinja, for exported tokenizer_config.json and
chat_template.json: no default system prompt; a system turn only if messages[0] is one or tools are given;
images <|vision_start|><|image_pad|><|vision_end|> and videos <|vision_start|><|video_pad|><|vision_end|>
(with "Picture N: " / "Video N: " when add_vision_id); assistant tool calls as <tool_call> JSON; tool results
grouped into one user turn of <tool_response> blocks; the generation prompt <|im_start|>assistant\\n."""

# A content item list or string -> text; images and videos are counted over the whole conversation.
_CONTENT = r"""
        {%- if message.content is string %}
            {{- message.content }}
        {%- elif message.content %}
            {%- for item in message.content %}
                {%- if item.type == 'image' or 'image' in item or 'image_url' in item %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif item.type == 'video' or 'video' in item %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
                {%- elif 'text' in item %}
                    {{- item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}"""

CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- set message = messages[0] %}""" + _CONTENT + r"""
        {{- '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        ~ '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        ~ '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- if not tools %}
            {{- '<|im_start|>system\n' }}""" + _CONTENT + r"""
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}""" + _CONTENT + r"""
        {{- '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' }}""" + _CONTENT + r"""
        {%- if message.role == 'assistant' and message.tool_calls %}
            {%- for tc in message.tool_calls %}
                {%- set tc = tc.function if tc.function else tc %}
                {%- if not loop.first or message.content %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n{"name": "' + tc.name + '", "arguments": ' }}
                {%- if tc.arguments is string %}{{- tc.arguments }}{%- else %}{{- tc.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
